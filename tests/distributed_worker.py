"""A training process for tests/test_distributed.py, started by torchrun: trains one of the models below
data-parallel (``rg.Trainer(..., distributed=True)``) and writes this rank's parameters, optimizer state and
per-step losses to ``<out>/rank<r>.npz``, so the test can compare the ranks with each other and with one
process. Run as ``torchrun --nproc-per-node 2 tests/distributed_worker.py --model mlp --out DIR``."""

from __future__ import annotations

import argparse
import os

import numpy as np
from kit import lossdata_models

import revgraph as rg
import revgraph.train.distributed.data_parallel
from revgraph.errors import NonFiniteError
from revgraph.ir import Graph, Node, ValueInfo
from revgraph.tools import demo
from revgraph.train import make_optimizer

VOCAB, TOKENS, DIM, CLASSES = 40, 6, 8, 5


def embedding_model(seed: int = 0) -> Graph:
    """Token ids int64 ``[N, 6]`` -> an embedding table ``E`` [40, 8] read only through ``Gather`` (so its
    gradient is sparse rows) -> mean over tokens -> a linear layer to 5 classes."""
    rng = np.random.default_rng(seed)
    inits = {"E": rng.standard_normal((VOCAB, DIM)).astype(np.float32),
             "W": (rng.standard_normal((DIM, CLASSES)) / np.sqrt(DIM)).astype(np.float32),
             "b": np.zeros(CLASSES, np.float32), "axis1": np.array([1], np.int64)}
    nodes = [Node("Gather", ["E", "ids"], ["emb"], {"axis": 0}, "embed"),
             Node("ReduceMean", ["emb", "axis1"], ["pooled"], {"keepdims": 0}, "pool"),
             Node("Gemm", ["pooled", "W", "b"], ["logits"], {}, "head")]
    return Graph(nodes, [ValueInfo("ids", np.int64, ("N", TOKENS))], [ValueInfo("logits", np.float32, ("N", CLASSES))],
                 inits, name="embedding")


#: the static inputs (fed whole to every step) of the models that have them
STATIC = {"static": lambda: lossdata_models.static_data()[1]}
#: the loss and its options of the models not trained with plain cross-entropy
LOSS = {"lm": ("causal-lm", {"labels_from": "labels", "label_smoothing": 0.1})}


def build(model: str, samples: int, hidden: int = 16) -> tuple[Graph, dict[str, np.ndarray]]:
    """The model and its training data (deterministic); ``hidden``: the MLP's and the RNN's width. ``static``: an
    MLP with static inputs (:data:`STATIC`); ``lm``: a tiny causal LM whose padded labels (-100) leave the ranks
    different numbers of counted tokens."""
    if model == "static":
        data, _ = lossdata_models.static_data(samples)
        return lossdata_models.static_model(), data
    if model == "lm":
        ids, labels = lossdata_models.lm_data(samples)
        return lossdata_models.tiny_lm(), {"input_ids": ids, "labels": labels}
    if model == "embedding":
        rng = np.random.default_rng(1)
        ids = rng.integers(0, VOCAB, (samples, TOKENS)).astype(np.int64) % (VOCAB // 2)  # half the rows: repeats
        return embedding_model(), {"ids": ids, "labels": rng.integers(0, CLASSES, samples)}
    train, _ = demo.digits()
    data = {"x": train["x"][:samples], "labels": train["labels"][:samples]}
    return (demo.rnn_model(hidden=hidden) if model == "rnn" else demo.mlp_model(hidden=hidden)), data


OPTIMIZERS = {"adam": {"name": "adam", "lr": 0.01}, "sgd": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
              "sgd0": {"name": "sgd", "lr": 0.05},
              "adamw": {"name": "adamw", "lr": 0.01, "weight_decay": 0.1}}


def trainer(model: str, optimizer: str, samples: int, distributed: bool, hidden: int = 16,
            **how) -> tuple[rg.Trainer, dict]:
    """The model's Trainer (``how``: more Trainer arguments, e.g. ``bucket_mb``, ``shard``) and its data."""
    g, data = build(model, samples, hidden)
    opt = make_optimizer(**OPTIMIZERS[optimizer])
    loss, options = LOSS.get(model, ("cross-entropy", None))
    return rg.Trainer(g, loss, opt, threads=1, distributed=distributed, loss_options=options, **how), data


def schedule_options(kind: str = "constant", warmup: int = 0, min_lr: float = 0.0, clip: float | None = None,
                     decay_all: bool = False) -> dict:
    """Trainer keyword arguments of a schedule, clipping and weight-decay exclusions (revgraph.train.schedules)."""
    from revgraph.train.schedules import Schedule

    how: dict = {"clip_grad_norm": clip, "no_decay": "none" if decay_all else None}
    if kind != "constant" or warmup:
        how["schedule"] = Schedule(kind, warmup, min_lr)
    return how


def receive_codes(engine) -> list[int]:
    """Where each unit's reduce-scatter receives on the CPU (revgraph.train.distributed.swap): 0 all-reduced, 1 the
    parameter chunks of the other ranks, 2 the gradient shard; empty for an engine without units."""
    codes = []
    for u, into in zip(getattr(engine, "units", []), getattr(engine, "_receive", []), strict=True):
        codes.append(0 if into is None else 2 if any(v.data_ptr() == u.gshard.data_ptr() for v in into.values())
                     else 1)
    return codes


def force_receive(kind: str) -> None:
    """Make every unit's reduce-scatter receive as ``kind`` says ("all-reduce": none is pairwise; "shard": into the
    gradient shard where it is apart from the bucket), whatever the graph, so that each way is tested."""
    from revgraph.train.distributed import swap

    rule = swap.receivers

    def forced(u, rank, world, plan, j, bucket):
        if kind == "all-reduce":
            return None
        apart = bucket is not None and u.gshard.untyped_storage().data_ptr() != bucket.untyped_storage().data_ptr()
        return {1 - rank: u.gshard} if apart and world == 2 else rule(u, rank, world, plan, j, bucket)

    swap.receivers = forced


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="mlp")
    p.add_argument("--optimizer", default="adam", help="one optimizer, or several separated by commas (one run "
                   "each, written to rank<r>-<optimizer>.npz)")
    p.add_argument("--samples", type=int, default=97)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--shard", default="none")
    p.add_argument("--bucket-bytes", type=int, help="the largest gradient bucket, in bytes (--bucket-mb of that size)")
    p.add_argument("--checkpoint-dir")
    p.add_argument("--no-cut", action="store_true", help="ZeRO-2 without the cut backward (one run writes every "
                   "gradient; the fallback for grad graphs revgraph.train.distributed.grad_segments cannot cut)")
    p.add_argument("--out", required=True)
    p.add_argument("--skew", action="store_true", help="rank 1 trains on one sample less (a user's mistake)")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--reduce-dtype", default="fp32")
    p.add_argument("--no-overlap", action="store_true")
    p.add_argument("--accumulate-steps", type=int, default=1)
    p.add_argument("--lr-schedule", default="constant", help="revgraph.train.schedules: the schedule (with "
                   "--warmup-steps, --min-lr), clipping (--clip-grad-norm) and weight decay on every parameter "
                   "(--decay-all)")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--min-lr", type=float, default=0.0)
    p.add_argument("--clip-grad-norm", type=float)
    p.add_argument("--decay-all", action="store_true")
    p.add_argument("--poison", type=int, help="sample N's features are NaN: the step that trains on it stops the "
                   "run (NonFiniteError), whose message is saved as 'stopped'")
    p.add_argument("--receive", choices=("auto", "shard", "all-reduce"), default="auto", help="where ZeRO-1/2's "
                   "pairwise reduce-scatter receives on the CPU (revgraph.train.distributed.swap.receivers): its "
                   "rule, or forced: the gradient shard (one peer, units apart from the bucket), or all-reduced")
    p.add_argument("--read-each-step", action="store_true", help="rank 0 reads the parameters after every step "
                   "(a callback), and notes whether a parameter all-gather was still in flight then; saved as "
                   "'each:<name>' (steps stacked) and 'in_flight' (how many steps left one)")
    a = p.parse_args()
    if a.receive != "auto":
        force_receive(a.receive)
    if a.bucket_bytes:
        a.bucket_mb = a.bucket_bytes / 2**20
    if a.no_cut:
        import revgraph.train.distributed.grad_segments

        revgraph.train.distributed.grad_segments.cut = lambda *args: None
    samples = a.samples - (a.skew and os.environ.get("RANK") == "1")
    several = "," in a.optimizer
    for optimizer in a.optimizer.split(","):
        how = dict(bucket_mb=a.bucket_mb, reduce_dtype=a.reduce_dtype, overlap=not a.no_overlap,
                   **schedule_options(a.lr_schedule, a.warmup_steps, a.min_lr, a.clip_grad_norm, a.decay_all))
        if a.shard != "none":
            how["shard"] = a.shard
        tr, data = trainer(a.model, optimizer, samples, True, a.hidden, **how)
        if a.poison is not None:
            data["x"][a.poison] = np.nan
        means, stopped, each, in_flight = [], "", [], []

        def read_each_step(record, tr=tr, each=each, in_flight=in_flight):  # (rank 0: reading is local, ZeRO-1/2)
            in_flight.append(bool(getattr(tr._engine, "_gathering", None)))
            each.append(tr.parameters)

        try:
            means = tr.fit(data, a.epochs, a.batch_size, seed=3, progress=False, checkpoint_dir=a.checkpoint_dir,
                           accumulate_steps=a.accumulate_steps, callbacks=[read_each_step] if a.read_each_step else (),
                           static=STATIC[a.model]() if a.model in STATIC else None)
        except NonFiniteError as exc:
            if a.poison is None:
                raise
            stopped = str(exc)
        held = tr._engine.held()
        name = f"rank{tr.rank}-{optimizer}.npz" if several else f"rank{tr.rank}.npz"
        np.savez(os.path.join(a.out, name), **tr.parameters, **tr.state, losses=np.array(tr.losses),
                 means=np.array(means), world=np.array(tr.world_size), stopped=np.array(stopped),
                 **{f"held:{k}": np.array(v) for k, v in held.items()},
                 units=np.array([[u.length, u.k, u.used] for u in getattr(tr._engine, "units", [])]).reshape(-1, 3),
                 segments=np.array(len(tr._engine.plan.segments) if getattr(tr._engine, "plan", None) else 0),
                 receive=np.array(receive_codes(tr._engine), np.int64), in_flight=np.array(sum(in_flight)),
                 **{f"each:{n}": np.stack([e[n] for e in each]) for n in (each[0] if each else ())})
        if a.bucket_mb < 1 and not a.no_overlap and os.environ.get("RANK") == "0" and a.shard == "none":
            segs = getattr(tr._engine, "segments", None)  # the test checks the cut happened
            print(f"segments: {len(segs.segments) if segs else 0}")
    tr.comm.close()


if __name__ == "__main__":
    main()
