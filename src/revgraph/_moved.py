"""The import paths of modules that moved into the layer packages (issue 29) keep working: ``import
revgraph.lora`` and ``from revgraph.schedules import cosine`` give the module at its new place
(:data:`MOVED`), the same module object, imported only when asked for. New code imports the new paths."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

#: old module -> where it is now (both under ``revgraph.``)
MOVED = {
    "ssa": "ir.ssa", "schema": "ir.schema", "constants": "ir.constants", "fastshape": "ir.fastshape",
    "inplace": "ir.inplace",
    "reading": "onnx_io.reading", "onnx_stream": "onnx_io.stream", "onnx_check": "onnx_io.part_check",
    "external_data": "onnx_io.external_data", "upgrade": "onnx_io.upgrade", "portable": "onnx_io.portable",
    "atomic": "onnx_io.atomic", "archive": "onnx_io.archive", "npz": "onnx_io.npz", "types": "onnx_io.value_types",
    "runtime_options": "runtime.options", "devices": "runtime.devices", "reference_ops": "runtime.reference_ops",
    "trainer": "train.trainer", "steps": "train.engines", "steptimes": "train.steptimes",
    "progress_bar": "train.progress_bar", "losses": "train.losses", "optimizers": "train.optimizers",
    "schedules": "train.schedules", "precision": "train.precision", "selection": "train.selection",
    "lora": "train.lora", "graphbuild": "train.graphbuild", "data": "train.data", "checkpoints": "train.snapshots",
    "snapshot_checks": "train.snapshot_checks", "run_record": "train.run_record",
    "distributed": "train.distributed.data_parallel", "exchange": "train.distributed.exchange",
    "overlap": "train.distributed.overlap", "grad_segments": "train.distributed.grad_segments",
    "graph_collectives": "train.distributed.graph_collectives", "sharding": "train.distributed.sharding",
    "shard_plan": "train.distributed.shard_plan", "sync_batchnorm": "train.distributed.sync_batchnorm",
    "sync_batchnorm_engine": "train.distributed.sync_batchnorm_engine", "launch": "train.distributed.launch",
    "ray_launcher": "train.distributed.ray_launcher",
    "cli_exchange": "cli.exchange", "cli_forward": "cli.forward", "cli_io": "cli.common", "cli_lora": "cli.lora",
    "cli_lossdata": "cli.lossdata", "cli_numbers": "cli.numeric", "cli_schedules": "cli.schedules",
    "cli_train": "cli.train", "cli_write": "cli.write",
    "check": "tools.check", "lift": "tools.lift", "viz": "tools.viz", "demo": "tools.demo",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``revgraph.<old>`` and loads it as the module at its new place (module objects are shared, so a
    monkeypatch through either path is seen through both)."""

    def find_spec(self, fullname, path=None, target=None):
        head, _, rest = fullname.partition(".")
        if head == "revgraph" and rest in MOVED:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        module = importlib.import_module("revgraph." + MOVED[spec.name.partition(".")[2]])
        spec.loader_state = module.__spec__  # its own spec, given back by exec_module
        return module

    def exec_module(self, module):
        # imported at its new place already; the import system has set the alias's spec on it, whose parent
        # ("revgraph") is not the module's package: give it its own spec back (relative imports in its functions
        # compare the two)
        module.__spec__ = module.__spec__.loader_state


def install() -> None:
    """Add the finder once (``import revgraph`` does)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
