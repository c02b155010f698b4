"""``revgraph train``: one process, data-parallel under torchrun, or ``--nproc N`` launching torchrun itself."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rich.console import Console

from .cli_exchange import check_exchange_arguments, profile_line, trainer_arguments
from .cli_io import check_command_outputs, err, out, read_npz
from .devices import Device
from .errors import RevgraphError
from .onnx_io import load
from .autodiff.memory import Budget, parse_budget
from .runtime_options import RuntimeOptions


def add_runtime_arguments(parser: argparse.ArgumentParser, defaults: str) -> None:
    """``--arena on|off``, ``--memory-pattern on|off`` and ``--execution-order ...`` (:class:`RuntimeOptions`);
    ``defaults`` says in the help what an option left out means."""
    from .runtime_options import EXECUTION_ORDERS

    parser.add_argument("--arena", choices=("on", "off"),
                        help=f"onnxruntime's CPU memory arena (enable_cpu_mem_arena; default: {defaults})")
    parser.add_argument("--memory-pattern", choices=("on", "off"),
                        help=f"onnxruntime's planned allocation of intermediate tensors (enable_mem_pattern; default: "
                             f"{defaults})")
    parser.add_argument("--execution-order", choices=tuple(EXECUTION_ORDERS),
                        help="the order onnxruntime runs nodes in (memory_efficient needs an onnxruntime training "
                             "build; default: default)")


def runtime_from_args(args: argparse.Namespace) -> RuntimeOptions:
    """The :class:`RuntimeOptions` of ``--arena``, ``--memory-pattern`` and ``--execution-order`` (``None``
    for each option left out)."""
    flag = {"on": True, "off": False, None: None}
    return RuntimeOptions(arena=flag[args.arena], memory_pattern=flag[args.memory_pattern],
                          execution_order=args.execution_order)


def cmd_train(args: argparse.Namespace) -> int:
    import warnings

    from .distributed import under_torchrun
    from .train import make_optimizer
    from .trainer import Trainer

    if args.threads < 0 or args.checkpoint_every < 0:  # before any worker starts, too
        raise RevgraphError("--threads and --checkpoint-every must be >= 0")
    check_exchange_arguments(args)
    budget = parse_budget(args.memory_budget) if args.memory_budget is not None else None  # (checked before launching)
    if args.nproc is not None:
        return _launch_torchrun(args)
    distributed = under_torchrun()
    _check_train_outputs(args)  # fail before training, not after
    data = read_npz(args.data)
    test = read_npz(args.test_data) if args.test_data is not None else None
    opt = make_optimizer(args.optimizer, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    g = load(args.model)
    if budget is not None:  # symbolic first dimensions of the inputs are the batch: --batch-size of them
        dims = {vi.shape[0]: args.batch_size for vi in g.inputs if vi.shape and isinstance(vi.shape[0], str)}
        budget = Budget(fraction=budget.fraction, bytes=budget.bytes, dims=dims)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(g, args.loss, opt, output=args.model_output, threads=args.threads, device=args.device,
                          distributed=distributed, runtime=runtime_from_args(args), buffers=args.buffers,
                          memory=budget, shard=args.shard, sync_batchnorm=args.sync_batchnorm,
                          **trainer_arguments(args))
    main = trainer.is_main  # only rank 0 prints and writes files
    console = out if main else Console(quiet=True)
    for w in caught if main else []:
        err.print(f"warning: {w.message}", soft_wrap=True, markup=False)
    if budget is not None:
        console.print(f"memory: {trainer.spec.graph.memory_plan.summary()}", soft_wrap=True, markup=False)
    trainer.arrays(data)  # bad data fails here, in one line, before anything runs
    if test is not None:
        trainer.arrays(test)
    if distributed:
        console.print(f"data-parallel on {trainer.world_size} processes (torch.distributed, "
                      f"{'nccl' if trainer.device.kind == 'cuda' else 'gloo'}): global batch "
                      f"{trainer.world_size} x {args.batch_size}"
                      + (f" x {args.accumulate_steps} micro-batches" if args.accumulate_steps > 1 else "")
                      + f" = {trainer.world_size * args.batch_size * args.accumulate_steps}"
                      + (f"; sharded: {args.shard} (ZeRO-{1 if args.shard == 'optimizer' else 2})"
                         if args.shard != "none" else ""),
                      soft_wrap=True, markup=False)
    before = trainer.evaluate(data)
    means = trainer.fit(data, args.epochs, args.batch_size, seed=args.seed, console=console,
                        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                        nonfinite="continue" if args.allow_nonfinite else "stop",
                        accumulate_steps=args.accumulate_steps)
    if trainer.resumed:
        console.print(f"resumed from {trainer.resumed}", soft_wrap=True, markup=False)
    after = trainer.evaluate(data)
    evaluated = trainer.evaluate(test) if test is not None else None
    if main:
        trainer.export(args.output)
        if args.save_training_graph:
            trainer.save_training_graph(args.save_training_graph)

    def score(ev: dict) -> str:
        if ev["nonfinite"] and trainer.spec.loss.kind != "mse":
            return f"loss {ev['loss']:.4g}, no accuracy ({ev['nonfinite']} outputs are NaN or infinite)"
        return f"loss {ev['loss']:.4g}" + ("" if ev["accuracy"] is None else f", accuracy {ev['accuracy']:.2%}")

    batch = f"batch size {args.batch_size}" + (f" x {trainer.world_size} processes" if distributed else "") + (
        f" x {args.accumulate_steps} accumulated micro-batches" if args.accumulate_steps > 1 else "")
    console.print(f"{trainer.steps} steps of {args.optimizer} ({args.epochs} epochs, {batch}); "
                  f"last epoch's mean loss {means[-1]:.4g}", soft_wrap=True, markup=False)
    console.print(f"training data ({before['samples']} samples): {score(before)} before, {score(after)} after",
                  soft_wrap=True, markup=False)
    if evaluated is not None:
        console.print(f"test data: {score(evaluated)}", soft_wrap=True, markup=False)
    if profile_line(trainer):
        console.print(profile_line(trainer), soft_wrap=True, markup=False)
    saved = f"; training graph: {args.save_training_graph}" if args.save_training_graph else ""
    console.print(f"wrote {args.output} (trained weights as initializers){saved}", soft_wrap=True, markup=False)
    if trainer.comm:
        trainer.comm.close()
    return 0


def _check_train_outputs(args: argparse.Namespace) -> None:
    """Every file ``train`` writes (-o, --save-training-graph, the checkpoint) can be written and is none of
    its inputs (the model, --data, --test-data): checked before training, not found out after it."""
    from .checkpoints import path_in

    ckpt = args.checkpoint_dir
    if ckpt is not None and (not ckpt or (os.path.exists(ckpt) and not os.path.isdir(ckpt))):
        raise RevgraphError(f"--checkpoint-dir {ckpt!r} is not a directory")
    outputs = {"-o": args.output, "--save-training-graph": args.save_training_graph,
               "the checkpoint file": str(path_in(ckpt)) if ckpt else None}
    check_command_outputs(args, outputs, {"--data": args.data, "--test-data": args.test_data},
                   creatable=("the checkpoint file",))


def _launch_torchrun(args: argparse.Namespace) -> int:
    """``revgraph train --nproc N ...``: check the arguments here (bad input fails in one line, before any
    worker starts), then run this command under ``torchrun --standalone --nproc-per-node N`` and return its
    exit code."""
    import subprocess

    if args.nproc < 1:
        raise RevgraphError(f"--nproc must be at least 1, got {args.nproc}")
    try:
        import torch.distributed.run
    except ImportError:
        raise RevgraphError('--nproc needs PyTorch for torchrun: pip install "revgraph[distributed]"') from None
    _check_train_outputs(args)
    device = Device.parse(args.device)
    device.providers()  # no CUDA provider: one line here rather than a failure in every worker
    if device.kind == "cuda":
        import torch

        if torch.cuda.device_count() < args.nproc:
            raise RevgraphError(f"--device cuda --nproc {args.nproc} runs one process per GPU, and torch sees "
                                f"{torch.cuda.device_count()} GPU(s) here")
    for f in [args.model, args.data, args.test_data]:
        if f is not None and not Path(f).is_file():
            raise RevgraphError(f"cannot read {f!r}: no such file")
    rest, skip = [], False
    for a in args.argv:  # the same command without --nproc
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "-m", "revgraph", *rest]
    # Restarted workers must not meet in the rendezvous store of the failed attempt (pytorch/pytorch#135712).
    return subprocess.call(cmd, env={**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
