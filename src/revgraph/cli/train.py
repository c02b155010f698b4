"""``revgraph train``: one process, data-parallel under torchrun, or ``--nproc N`` launching torchrun itself."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rich.console import Console

from ..autodiff.lift import lift_constants
from ..autodiff.memory import Budget, parse_budget
from ..errors import RevgraphError
from ..onnx_io import load
from ..runtime.devices import Device
from ..runtime.options import FROZEN_WEIGHTS, RuntimeOptions
from . import numeric as N
from .combinations import check_decay_options, check_train_combinations
from .common import check_command_outputs, err, note, out, quiet
from .exchange import add_exchange_arguments, check_exchange_arguments, profile_line, trainer_arguments
from .fit_options import add_fit_arguments, check_fit_arguments, eval_batch, eval_printer, fit_arguments
from .hf import add_safetensors_arguments, check_safetensors_output, write_safetensors_output
from .lora import add_lora_arguments, export_trained, lora_model, selection_line, written
from .lossdata import input_paths, loss_options, read_data, read_static, require_data
from .precision import add_precision_arguments, precision_from_args
from .runlog import RUNLOG_FILES, add_runlog_arguments, check_runlog_arguments, run_logs, runlog_outputs
from .schedules import add_embedding_update_argument, add_schedule_arguments, decay_line, schedule_settings


def optimizer_defaults(field: str) -> str:
    """``"0.01 for sgd, 0.001 for adam and adamw"``: each default of ``field`` of the registered optimizers
    (:data:`revgraph.train.optimizers.OPTIMIZERS`), with the optimizers that share it."""
    from ..train.optimizers import OPTIMIZERS, listed

    by_value: dict[float, list[str]] = {}
    for name, method in OPTIMIZERS.items():
        by_value.setdefault(method.defaults[field], []).append(name)
    return ", ".join(f"{v:g} for {listed(names)}" for v, names in by_value.items())


def weight_decay_help() -> str:
    """``--weight-decay``'s help: how each registered optimizer applies it, and the defaults that are not 0."""
    from ..train.optimizers import OPTIMIZERS

    by_kind: dict[str, list[str]] = {}
    for name, method in OPTIMIZERS.items():
        by_kind.setdefault(method.decay, []).append(name)
    nonzero = [f"{m.defaults['weight_decay']:g}" for m in OPTIMIZERS.values() if m.defaults["weight_decay"]]
    parts = [f"{kind} ({', '.join(names)}" for kind, names in by_kind.items()]
    tail = f"; default {', '.join(nonzero)}, else 0)" if nonzero else "; default 0)"
    return " or ".join(p + ")" for p in parts[:-1]) + (" or " if len(parts) > 1 else "") + parts[-1] + tail


def add_train_parser(sub, seed_type, memory_help: str) -> argparse.ArgumentParser:
    """The ``train`` subcommand's parser, its choices read from the library's registries (:data:`LOSSES`,
    :data:`OPTIMIZERS`, :data:`SHARDS`, :data:`BUFFERS`); ``seed_type`` parses ``--seed``."""
    from ..train.distributed.sharding import SHARDS
    from ..train.engines import BUFFERS
    from ..train.optimizers import OPTIMIZERS, takers
    from .lossdata import add_loss_data_arguments

    train = sub.add_parser("train", help="train a model: loss, gradients and optimizer step as one ONNX graph")
    train.add_argument("model", metavar="MODEL.onnx")
    add_loss_data_arguments(train)
    train.add_argument("--optimizer", choices=OPTIMIZERS, default="adam", help="(default adam)")
    train.add_argument("--lr", type=N.POSITIVE, metavar="LR",
                       help=f"learning rate (default: {optimizer_defaults('lr')})")
    train.add_argument("--momentum", type=N.MOMENTUM, metavar="M",
                       help=f"{'/'.join(takers('momentum'))} momentum (default 0)")
    train.add_argument("--weight-decay", type=N.NON_NEGATIVE, metavar="WD", help=weight_decay_help())
    add_fit_arguments(train)  # --epochs or --max-steps, --no-shuffle, --eval-data/--eval-every/--eval-batch-size
    train.add_argument("--batch-size", type=N.POSITIVE_INT, default=32, metavar="B", help="(default 32)")
    train.add_argument("--seed", type=seed_type, default=0, help="seed of the shuffling (default 0)")
    train.add_argument("--model-output", metavar="NAME", help="the output the loss reads (default: the only output)")
    train.add_argument("--test-data", metavar="TEST.npz|DIR", help="also report the loss (and accuracy) on these "
                       "arrays (an .npz or a directory of .npy files; --static inputs are fed to it too)")
    train.add_argument("--save-training-graph", metavar="FILE.onnx", help="also write the training-step graph")
    train.add_argument("-o", "--output", metavar="TRAINED.onnx", required=True, help="the model with trained weights")
    train.add_argument("--device", default="cpu", type=N.DEVICE, metavar="cpu|cuda[:i]",
                       help="where onnxruntime runs the step (cuda needs onnxruntime-gpu; default cpu)")
    train.add_argument("--threads", type=N.THREADS, default=0, metavar="T",
                       help="onnxruntime intra-op threads per process (default: its own choice; under torchrun the "
                            "machine's cores divided among the local processes)")
    # a training snapshot; "checkpoint" alone is the loop residual policy (grad --checkpoint). The old spellings
    # --checkpoint-dir and --checkpoint-every stay accepted, as options of their own (not in --help), so that a
    # refusal names the spelling the user wrote
    train.add_argument("--snapshot-dir", dest="checkpoint_dir", metavar="DIR",
                       help="save a training snapshot here (parameters, optimizer state, data position), and "
                            "resume from it")
    train.add_argument("--checkpoint-dir", dest="checkpoint_dir", metavar="DIR", help=argparse.SUPPRESS)
    train.add_argument("--snapshot-every", dest="checkpoint_every", type=N.NON_NEGATIVE_INT, default=0, metavar="N",
                       help="with --snapshot-dir: save every N steps (default: at the end of each epoch)")
    train.add_argument("--checkpoint-every", dest="checkpoint_every", type=N.NON_NEGATIVE_INT, default=0,
                       metavar="N", help=argparse.SUPPRESS)
    train.add_argument("--lift-constants", action="store_true",
                       help="train floating Constant/ConstantOfShape values with more than one element too, as "
                            "initializers (as revgraph grad --lift-constants; paddle2onnx writes weights as Constant "
                            "nodes)")
    train.add_argument("--straight-through", action="store_true",
                       help="quantization-aware training: differentiate QuantizeLinear -> DequantizeLinear pairs with "
                            "the straight-through estimator (as revgraph grad --straight-through; without it such a "
                            "pair on a path to the loss is refused)")
    train.add_argument("--allow-nonfinite", action="store_true",
                       help="train on when the loss becomes NaN or infinite (default: stop at that step, exit 2)")
    train.add_argument("--nproc", type=N.NPROC, metavar="N",
                       help="train data-parallel in N processes on this machine (starts torchrun; needs "
                            "revgraph[distributed]); the global batch is N x --batch-size x --nnodes")
    train.add_argument("--shard", choices=SHARDS, default="none",
                       help="data-parallel only: each process keeps the optimizer state of its 1/N shard of the "
                            "parameters (optimizer: ZeRO-1; gradients reduce-scattered, parameters all-gathered), "
                            "and of the gradients too (gradients: ZeRO-2), and keeps only that shard of the "
                            "parameters, each unit all-gathered just before the part of the step that reads it "
                            "(parameters: ZeRO-3, FSDP-style; for a model that does not fit one process); "
                            "checkpoints stay whole (default none)")
    train.add_argument("--sync-batchnorm", action="store_true",
                       help="data-parallel: training-mode BatchNormalization normalizes with the statistics of the "
                            "global batch, all-reduced inside the step as torch.nn.SyncBatchNorm does (default: each "
                            "process over its own share, rank 0's running statistics kept; rank 0 warns)")
    add_launch_arguments(train)
    add_runtime_arguments(train, "arena on and same_as_requested, memory pattern off, memory reuse off, "
                                 "priority_based, none: revgraph's order, measured best for training")
    train.add_argument("--frozen-weights", choices=FROZEN_WEIGHTS,
                       help="large frozen float weights (a LoRA base) on the CPU: shared, one copy that every session "
                            "reads (default), or constants of each session, which onnxruntime copies and prepacks: "
                            "a step up to 1.15x faster at small batches, at 4-8x their memory")
    train.add_argument("--memory-budget", type=N.MEMORY_BUDGET, metavar="F|BYTES",
                       help=memory_help + "; a byte count sizes the batch dimension with --batch-size")
    train.add_argument("--buffers", choices=BUFFERS, default="one",
                       help="parameters and optimizer state in one buffer set that the update overwrites where that "
                            "is safe, or in two swapped sets (the fused step graph; default one)")
    add_exchange_arguments(train)
    add_schedule_arguments(train)
    add_embedding_update_argument(train)  # how Gather'ed tables are updated (revgraph.train.optimizers)
    add_precision_arguments(train)  # --precision and the fp16 loss scaling (revgraph.cli.precision)
    add_lora_arguments(train)
    add_safetensors_arguments(train)  # --save-safetensors: the PyTorch state dict (revgraph.train.hf_io)
    add_runlog_arguments(train)  # --log, --tensorboard, --loss-curve: the per-step records (revgraph.train.runlog)
    return train


def add_runtime_arguments(parser: argparse.ArgumentParser, defaults: str) -> None:
    """``--arena on|off``, ``--arena-extend ...``, ``--memory-pattern on|off``, ``--memory-reuse on|off``,
    ``--execution-order ...`` and ``--graph-optimization ...`` (:class:`RuntimeOptions`); ``defaults`` says in the
    help what an option left out means."""
    from ..runtime.options import ARENA_EXTENDS, EXECUTION_ORDERS, GRAPH_OPTIMIZATIONS

    parser.add_argument("--arena", choices=("on", "off"),
                        help=f"onnxruntime's CPU memory arena (enable_cpu_mem_arena; default: {defaults})")
    parser.add_argument("--arena-extend", choices=tuple(ARENA_EXTENDS),
                        help="how the CPU arena grows: next_power_of_two (each session its own arena, chunks that "
                             "double) or same_as_requested (one arena for the process, grown by what is asked; "
                             f"default: {defaults})")
    parser.add_argument("--memory-pattern", choices=("on", "off"),
                        help=f"onnxruntime's planned allocation of intermediate tensors (enable_mem_pattern; default: "
                             f"{defaults})")
    parser.add_argument("--memory-reuse", choices=("on", "off"),
                        help="onnxruntime's planned reuse of a freed tensor's buffer by a later tensor of the same "
                             f"shape, held allocated in between (enable_mem_reuse; default: {defaults})")
    parser.add_argument("--execution-order", choices=tuple(EXECUTION_ORDERS),
                        help="the order onnxruntime runs nodes in: priority_based is the graph's own order "
                             f"(memory_efficient needs an onnxruntime training build; default: {defaults})")
    parser.add_argument("--graph-optimization", choices=tuple(GRAPH_OPTIMIZATIONS),
                        help=f"onnxruntime's graph optimization level (graph_optimization_level; default: {defaults})")


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """``--timeout`` and the options of ``--nproc`` for several machines (passed to torchrun with its c10d
    rendezvous; :func:`revgraph.train.distributed.launch.torchrun_arguments`)."""
    from ..train.distributed.launch import DEFAULT_TIMEOUT

    parser.add_argument("--timeout", type=N.TIMEOUT, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                        help="data-parallel: how long a process waits to join the others and in every collective "
                             "before it stops with an error, e.g. when another process stopped (torch.distributed's "
                             "init_process_group timeout), and with --nnodes how long torchrun's rendezvous waits for "
                             f"node 0 and the other machines (default {DEFAULT_TIMEOUT:g} s)")
    parser.add_argument("--nnodes", type=N.NNODES, default=1, metavar="M",
                        help="with --nproc: the number of machines, each running this command with "
                             "GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME for cuda) set to the network interface that "
                             "reaches the others (default 1)")
    parser.add_argument("--node-rank", type=N.NODE_RANK, metavar="R",
                        help="with --nnodes: 0 on the machine of --rdzv-endpoint (it hosts the rendezvous), 1..M-1 on "
                             "the others; torchrun numbers the processes by --local-addr, not by this")
    parser.add_argument("--rdzv-endpoint", type=N.ENDPOINT, metavar="HOST:PORT",
                        help="with --nnodes: the address of node 0 and a free port for torchrun's c10d rendezvous")
    parser.add_argument("--rdzv-id", default="revgraph", metavar="NAME",
                        help="with --nnodes: the name of this run, the same on every machine (default revgraph)")
    parser.add_argument("--local-addr", metavar="ADDR",
                        help="with --nnodes: this machine's address as the others reach it (needed where this "
                             "machine's name resolves to 127.0.0.1)")
    parser.add_argument("--max-restarts", type=N.NON_NEGATIVE_INT, default=0, metavar="K",
                        help="with --nproc: let torchrun restart all processes up to K times after a failure (one "
                             "line each on stderr: the rank, node, exit code or signal, restart k of K); with "
                             "--snapshot-dir they resume from the last snapshot (default 0)")


def runtime_from_args(args: argparse.Namespace) -> RuntimeOptions:
    """The :class:`RuntimeOptions` of ``--arena``, ``--arena-extend``, ``--memory-pattern``, ``--memory-reuse``,
    ``--execution-order``, ``--graph-optimization`` and, for ``train``, ``--frozen-weights`` (``None`` for each option
    left out)."""
    flag = {"on": True, "off": False, None: None}
    return RuntimeOptions(arena=flag[args.arena], arena_extend=args.arena_extend,
                          memory_pattern=flag[args.memory_pattern], memory_reuse=flag[args.memory_reuse],
                          execution_order=args.execution_order, graph_optimization=args.graph_optimization,
                          frozen_weights=getattr(args, "frozen_weights", None))  # (train's own)


def cmd_train(args: argparse.Namespace) -> int:
    from ..train.distributed.data_parallel import under_torchrun

    if args.threads < 0 or args.checkpoint_every < 0:  # before any worker starts, too
        raise RevgraphError("--threads and --snapshot-every must be >= 0")
    check_exchange_arguments(args)
    check_fit_arguments(args)
    precision_from_args(args)  # (the fp16 loss-scaling options, checked before any worker starts)
    if not args.timeout > 0:
        raise RevgraphError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    budget = parse_budget(args.memory_budget) if args.memory_budget is not None else None  # (checked before launching)
    distributed = under_torchrun()
    check_train_combinations(args, distributed)  # options that would do nothing: before any worker starts
    if args.nproc is not None and not distributed:  # (a worker started by --nproc gets the same arguments)
        return _launch_torchrun(args)
    given = [o for o, v in [("--nnodes", args.nnodes != 1), ("--node-rank", args.node_rank is not None),
                            ("--rdzv-endpoint", args.rdzv_endpoint), ("--local-addr", args.local_addr),
                            ("--max-restarts", args.max_restarts)] if v]
    if given and not distributed:
        raise RevgraphError(f"{given[0]} goes with --nproc N (under torchrun, give torchrun its own options)")
    if not distributed:
        return _train(args, budget, False)
    from ..train.distributed.data_parallel import CollectiveError
    from ..train.distributed.launch import die_with_parent, record_failure

    die_with_parent()  # at once: a killed torchrun agent must leave no worker behind, even while it loads
    try:
        return _train(args, budget, True)
    except RevgraphError as exc:  # deterministic (bad input, NaN loss, refused arguments): no restart may rerun it
        if not isinstance(exc, CollectiveError):
            record_failure(str(exc), int(os.environ.get("RANK", "0")), args.checkpoint_dir)
            from ..train.distributed.join import announce_refusal

            announce_refusal(str(exc), args.timeout)  # before the group exists: the others stop at once, naming us
        raise


def _train(args: argparse.Namespace, budget, distributed: bool) -> int:
    """The training of ``revgraph train`` in this process (one of the ranks with ``distributed``)."""
    import warnings

    from ..train.graphs import make_optimizer
    from ..train.trainer import Trainer

    _check_train_outputs(args)  # fail before training, not after
    require_data(args)  # before the model is loaded
    opt = make_optimizer(args.optimizer, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                         **schedule_settings(args))
    check_decay_options(args, opt.weight_decay)
    precision = precision_from_args(args)
    g = lift_constants(load(args.model))[0] if args.lift_constants else load(args.model)
    g, selected = lora_model(args, g)  # LoRA adapters, --train/--freeze: checked before training
    # the data after the model: only the members it reads are decompressed, each bounded by its declared shape
    static = read_static(args, g)
    data = read_data(args.data, graph=g)
    test = read_data(args.test_data, "--test-data", g) if args.test_data is not None else None
    evaluated_data = read_data(args.eval_data, "--eval-data", g) if args.eval_data is not None else None
    if budget is not None:  # symbolic first dimensions of the inputs are the batch: --batch-size of them
        dims = {vi.shape[0]: args.batch_size for vi in g.inputs
                if vi.shape and isinstance(vi.shape[0], str) and vi.name not in static}  # (static: fed whole)
        budget = Budget(fraction=budget.fraction, bytes=budget.bytes, dims=dims)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(g, args.loss, opt, output=args.model_output, threads=args.threads, device=args.device,
                          distributed=distributed, runtime=runtime_from_args(args), buffers=args.buffers,
                          memory=budget, shard=args.shard, sync_batchnorm=args.sync_batchnorm,
                          timeout=args.timeout, loss_options=loss_options(args), precision=precision,
                          straight_through=args.straight_through,
                          **selected, **trainer_arguments(args))
    del g  # (--shard parameters: the trainer keeps no full copy of the weights, and neither does this frame)
    if trainer.comm:
        _agree(trainer, args)
    main = trainer.is_main  # only rank 0 prints and writes files
    console = out if main else Console(quiet=True)
    for w in caught if main else []:
        err.print(f"warning: {w.message}", soft_wrap=True, markup=False)
    refused = None
    try:
        # bad data fails here, in one line, before anything runs; the checked Datasets go on to fit and evaluate
        # (checked once per run: the labels are scanned here only)
        data = trainer.arrays(data, static)
        test, evaluated_data = (None if a is None else trainer.arrays(a, static) for a in (test, evaluated_data))
    except RevgraphError as exc:
        if not trainer.comm:
            raise
        refused = str(exc)
    if trainer.comm:  # every rank stops, not only the one with bad data (the others would wait for it)
        trainer.comm.refuse_together(refused, "its data")
    # what trains, unless --quiet (after the data checks: a run refused for its data prints its one error line alone)
    note(console, selection_line(args, trainer))  # (information lines: not with --quiet)
    if budget is not None:
        note(console, f"memory: {trainer.spec.graph.memory_plan.summary()}")
    if decay_line(trainer):
        note(console, decay_line(trainer))
    if distributed:
        note(console, f"data-parallel on {trainer.world_size} processes (torch.distributed, "
              f"{'nccl' if trainer.device.kind == 'cuda' else 'gloo'}): global batch "
              f"{trainer.world_size} x {args.batch_size}"
              + (f" x {args.accumulate_steps} micro-batches" if args.accumulate_steps > 1 else "")
              + f" = {trainer.world_size * args.batch_size * args.accumulate_steps}"
              + (f"; sharded: {args.shard} (ZeRO-{ {'optimizer': 1, 'gradients': 2}.get(args.shard, 3)})"
                 if args.shard != "none" else ""))
    callbacks = [eval_printer(console, None if quiet() else args.eval_every)]
    steps_before = trainer.steps
    with run_logs(args, trainer) as logs:  # --log, --tensorboard, --loss-curve (rank 0), closed on errors too
        means = trainer.fit(data, batch_size=args.batch_size, seed=args.seed, console=console,
                            progress=not quiet(), checkpoint_dir=args.checkpoint_dir,
                            checkpoint_every=args.checkpoint_every,
                            nonfinite="continue" if args.allow_nonfinite else "stop",
                            accumulate_steps=args.accumulate_steps, static=static, override=args.override,
                            callbacks=callbacks + logs, **fit_arguments(args, evaluated_data))
    if trainer.resumed:
        console.print(f"resumed from {trainer.resumed}", soft_wrap=True, markup=False)
    final = None
    if evaluated_data is not None and trainer.steps == steps_before:  # (a finished run resumed: fit ran no step)
        final = trainer.evaluate(evaluated_data, eval_batch(args), static=static)
    tested = trainer.evaluate(test, eval_batch(args), static=static) if test is not None else None
    if main:
        export_trained(trainer, args)
        write_safetensors_output(trainer, args)
        if args.save_training_graph:
            trainer.save_training_graph(args.save_training_graph)

    def score(ev: dict) -> str:
        if ev["nonfinite"] and trainer.spec.loss.kind != "mse":
            return f"loss {ev['loss']:.4g}, no accuracy ({ev['nonfinite']} outputs are NaN or infinite)"
        return f"loss {ev['loss']:.4g}" + ("" if ev["accuracy"] is None else f", accuracy {ev['accuracy']:.2%}")

    batch = f"batch size {args.batch_size}" + (f" x {trainer.world_size} processes" if distributed else "") + (
        f" x {args.accumulate_steps} accumulated micro-batches" if args.accumulate_steps > 1 else "")
    console.print(f"{trainer.steps} steps of {args.optimizer} ({len(means)} epochs, {batch}); "
                  f"last epoch's mean loss {means[-1]:.4g}" if means else
                  f"{trainer.steps} steps of {args.optimizer} ({batch})", soft_wrap=True, markup=False)
    if final or trainer.last_evaluation:
        console.print(f"eval data: {score(final or trainer.last_evaluation)}", soft_wrap=True, markup=False)
    if tested is not None:
        console.print(f"test data: {score(tested)}", soft_wrap=True, markup=False)
    if profile_line(trainer):
        console.print(profile_line(trainer), soft_wrap=True, markup=False)
    saved = f"; training graph: {args.save_training_graph}" if args.save_training_graph else ""
    console.print(f"wrote {args.output} ({written(args, trainer)}){saved}", soft_wrap=True, markup=False)
    if trainer.comm:
        trainer.comm.close()
    return 0


def _agree(trainer, args: argparse.Namespace) -> None:
    """Under torchrun, before anything runs: stop at once if an earlier attempt of this run failed
    deterministically, and refuse ranks whose command differs in what only the command line knows (the optimizer
    and fit arguments are compared by the Trainer): which outputs and test data are given, --threads aside."""
    from ..train.distributed.launch import recorded_failure

    recorded_failure(trainer.comm, args.checkpoint_dir)
    given = {"--test-data given": args.test_data is not None, "--save-training-graph given":
             args.save_training_graph is not None, "--snapshot-dir given": args.checkpoint_dir is not None,
             "--eval-data given": args.eval_data is not None, "--eval-every": args.eval_every,
             "--eval-batch-size": args.eval_batch_size, "--max-steps": args.max_steps, "--no-shuffle": args.no_shuffle,
             "--epochs": args.epochs, "--batch-size": args.batch_size, "--seed": args.seed,
             "--snapshot-every": args.checkpoint_every, "--allow-nonfinite": args.allow_nonfinite,
             "--memory-budget": args.memory_budget}
    trainer.comm.check_same(given, "train arguments", "run the same command on every rank (only the file paths "
                            "may differ between machines)")


def _check_train_outputs(args: argparse.Namespace) -> None:
    """Every file ``train`` writes (-o, --save-training-graph, the checkpoint) can be written and is none of
    its inputs (the model, --data, --test-data): checked before training, not found out after it."""
    from ..train.snapshots import path_in

    ckpt = args.checkpoint_dir
    if ckpt is not None and (not ckpt or (os.path.exists(ckpt) and not os.path.isdir(ckpt))):
        raise RevgraphError(f"--snapshot-dir {ckpt!r} is not a directory")
    check_safetensors_output(args)
    outputs = {"-o": args.output, "--save-training-graph": args.save_training_graph,
               "--save-safetensors": args.save_safetensors,
               "the checkpoint file": str(path_in(ckpt)) if ckpt else None, **runlog_outputs(args)}
    check_runlog_arguments(args, input_paths(args), outputs)
    check_command_outputs(args, outputs, input_paths(args), models=("-o", "--save-training-graph"),
                          creatable=("the checkpoint file",),
                          regular=("the checkpoint file", *RUNLOG_FILES))


def _launch_torchrun(args: argparse.Namespace) -> int:
    """``revgraph train --nproc N ...``: check the arguments here (bad input fails in one line, before any
    worker starts), then run this same command under torchrun (in this process,
    :func:`revgraph.train.distributed.launch.run_torchrun`: ``--standalone`` on one machine, c10d rendezvous with
    ``--nnodes``) and return revgraph's exit code."""
    if args.nproc < 1:
        raise RevgraphError(f"--nproc must be at least 1, got {args.nproc}")
    try:
        import torch.distributed.run
    except ImportError:
        raise RevgraphError('--nproc needs PyTorch for torchrun: pip install "revgraph[distributed]"') from None
    from ..train.distributed.launch import run_torchrun, torchrun_arguments

    _check_train_outputs(args)
    device = Device.parse(args.device)
    device.providers()  # no CUDA provider: one line here rather than a failure in every worker
    if device.kind == "cuda":
        import torch

        if torch.cuda.device_count() < args.nproc:
            raise RevgraphError(f"--device cuda --nproc {args.nproc} runs one process per GPU, and torch sees "
                                f"{torch.cuda.device_count()} GPU(s) here")
    for f in [args.model, *input_paths(args).values()]:
        if f is not None and not Path(f).is_file() and not Path(f).is_dir():
            raise RevgraphError(f"cannot read {f!r}: no such file")
    argv = torchrun_arguments(args, list(args.argv))  # the workers get this command; under torchrun, they train
    # Restarted workers host a new store each attempt instead of reusing the agent's (pytorch/pytorch#135712)
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if args.nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it, without its banner
    sys.stdout.flush()
    return run_torchrun(argv, args)
