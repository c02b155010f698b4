"""Mutation fuzzing of the command line (used by tests/test_fuzz.py; also runnable by hand).

Seed models (several operators with initializers, a Loop, an If, a model with external data) are mutated: a
random protobuf field set to a hostile value (an edge integer, NaN, a name from the model or an escape
sequence, a cleared message, a deleted or duplicated list element, a bad enum), or random bytes flipped,
cut or inserted in the serialized file. Each mutant runs ``info``, ``grad``, ``run`` and ``check`` in a child
process forked from this one (revgraph already imported, so a mutant costs milliseconds, not an interpreter
start), under a memory limit and a timeout, in an empty directory. A command passes when it exits 0 or 2
(``check`` also 1: gradients that disagree are a verdict, not a crash), with no traceback, on a refusal
exactly one line on stderr, and when it leaves no file behind but its own output on success.

    python tests/kit/fuzz.py --count 200 --seed 1 --save /tmp/fuzz-repro

Training snapshots (``train --checkpoint-dir``) are mutated by tests/kit/snapshot_fuzz.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.descriptor import FieldDescriptor as FD
from onnx import TensorProto, helper, numpy_helper

from revgraph.cli import main  # imported once here: each forked child starts with it loaded

COMMANDS = {
    "info": ["info", "m.onnx"],
    "grad": ["grad", "m.onnx", "-o", "g.onnx"],
    "run": ["run", "m.onnx", "-o", "out.npz"],
    "check": ["check", "m.onnx"],
}
OUTPUTS = {"grad": "g.onnx", "run": "out.npz"}
MEMORY_LIMIT = 6 << 30  # address space of a mutant's process
TIMEOUT = 60.0  # seconds for the four commands of one mutant


# ------------------------------------------------------------------------------------------------- seeds


def _vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def _model(nodes, inputs, outputs, inits=(), opset=17):
    g = helper.make_graph(nodes, "seed", inputs, outputs, initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def seed_models() -> dict[str, onnx.ModelProto]:
    """The valid models that mutants start from (name -> model); ``external`` keeps its weight in
    ``w.data`` (written by :func:`write_seed`)."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w1")
    b1 = numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "b1")
    mlp = _model(
        [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm"),
         helper.make_node("Add", ["h", "b1"], ["a"], name="add"),
         helper.make_node("Tanh", ["a"], ["t"], name="tanh"),
         helper.make_node("Softmax", ["t"], ["s"], name="softmax", axis=-1),
         helper.make_node("Mul", ["s", "t"], ["p"], name="mul"),
         helper.make_node("ReduceSum", ["p"], ["y"], name="sum", keepdims=0)],
        [_vi("x", [2, 4])], [_vi("y", [])], [w1, b1])

    body = helper.make_graph(
        [helper.make_node("Mul", ["h_in", "w"], ["m"], name="body_mul"),
         helper.make_node("Sin", ["m"], ["h_out"], name="body_sin"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond")],
        "body", [_vi("i", [], TensorProto.INT64), _vi("cond_in", [], TensorProto.BOOL), _vi("h_in", [3])],
        [_vi("cond_out", [], TensorProto.BOOL), _vi("h_out", [3])])
    loop = _model(
        [helper.make_node("Loop", ["trip", "", "x"], ["h"], name="loop", body=body),
         helper.make_node("ReduceSum", ["h"], ["y"], name="sum", keepdims=0)],
        [_vi("x", [3])], [_vi("y", [])],
        [numpy_helper.from_array(np.array(3, np.int64), "trip"),
         numpy_helper.from_array(np.array([0.5, -1.0, 2.0], np.float32), "w")])

    def branch(name, op):
        return helper.make_graph([helper.make_node(op, ["x"], [f"{name}_out"], name=f"{name}_op")], name, [],
                                 [_vi(f"{name}_out", [3])])

    cond = _model(
        [helper.make_node("ReduceSum", ["x"], ["s"], name="sum", keepdims=0),
         helper.make_node("Greater", ["s", "zero"], ["c"], name="gt"),
         helper.make_node("If", ["c"], ["r"], name="if", then_branch=branch("then", "Exp"),
                          else_branch=branch("else", "Neg")),
         helper.make_node("ReduceMean", ["r"], ["y"], name="mean", keepdims=0)],
        [_vi("x", [3])], [_vi("y", [])], [numpy_helper.from_array(np.array(0.0, np.float32), "zero")])

    wx = numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "wx")
    external = _model(
        [helper.make_node("Gemm", ["x", "wx"], ["h"], name="gemm", transB=1),
         helper.make_node("Relu", ["h"], ["r"], name="relu"),
         helper.make_node("ReduceL2", ["r"], ["y"], name="l2", keepdims=0)],
        [_vi("x", [2, 8])], [_vi("y", [])], [wx])
    onnx.external_data_helper.convert_model_to_external_data(external, location="w.data", size_threshold=0)
    return {"mlp": mlp, "loop": loop, "if": cond, "external": external}


def write_seed(model: onnx.ModelProto, directory: Path) -> bytes:
    """Serialize ``model`` (writing its external data, if any, to ``directory``); return the model bytes."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    if any(t.data_location == TensorProto.EXTERNAL for t in m.graph.initializer):
        onnx.external_data_helper.write_external_data_tensors(m, str(directory))
    return m.SerializeToString()


# ---------------------------------------------------------------------------------------------- mutation

_INTS = [0, 1, -1, 2, 3, 7, 255, 2**31 - 1, -(2**31), 2**32, 2**62, 2**63 - 1, -(2**63), 10**12]
_FLOATS = [0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e38, 1e-45]
_STRINGS = ["", "x", "y", "w1", "\x1b[2J", "a\nb", "[bold]z[/]", "../../etc/passwd", "/abs", "file", "é" * 3,
            "x" * 300, "Loop", "If", "ai.onnx.ml", "custom", "\u202eevil", "\x00"]


def _messages(root):
    """Every message in ``root``'s tree (iteratively)."""
    found, stack = [], [root]
    while stack:
        msg = stack.pop()
        found.append(msg)
        for field, value in msg.ListFields():
            if field.type == FD.TYPE_MESSAGE:
                stack.extend(value if field.is_repeated else [value])
    return found


def _names(model) -> list[str]:
    names = set()
    for msg in _messages(model.graph):
        for attr in ("name", "input", "output"):
            value = getattr(msg, attr, None)
            if isinstance(value, str):
                names.add(value)
            elif value is not None and not isinstance(value, (bytes, int)) and hasattr(value, "__iter__"):
                names.update(v for v in value if isinstance(v, str))
    return sorted(names)


def _value(field, rng, names):
    t = field.type
    if t in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32):
        return int(np.clip(rng.choice(_INTS), -(2**31), 2**31 - 1))
    if t in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        return int(rng.choice(_INTS))
    if t in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
        return int(np.clip(abs(int(rng.choice(_INTS))), 0, 2**32 - 1))
    if t in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
        return int(np.clip(abs(int(rng.choice(_INTS))), 0, 2**64 - 1))
    if t in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
        return float(rng.choice(_FLOATS))
    if t == FD.TYPE_BOOL:
        return bool(rng.integers(2))
    if t == FD.TYPE_ENUM:
        values = [v.number for v in field.enum_type.values]
        return int(rng.choice([*values, len(values) + 5]))
    if t == FD.TYPE_STRING:
        return str(rng.choice(names + _STRINGS)) if rng.random() < 0.9 else "".join(
            chr(int(c)) for c in rng.integers(1, 0x250, int(rng.integers(1, 12))))
    if t == FD.TYPE_BYTES:
        return bytes(rng.integers(0, 256, int(rng.integers(0, 40))).astype(np.uint8))
    raise TypeError(t)


def mutate_field(model: onnx.ModelProto, rng: np.random.Generator) -> str:
    """Change one field of one message of ``model`` in place; return what was done."""
    names = _names(model)
    msg = _messages(model)[int(rng.integers(len(_messages(model))))]
    fields = list(msg.DESCRIPTOR.fields)
    field = fields[int(rng.integers(len(fields)))]
    where = f"{msg.DESCRIPTOR.name}.{field.name}"
    if field.is_repeated:
        items = getattr(msg, field.name)
        choice = rng.integers(4) if len(items) else 3
        if choice == 0:
            del items[int(rng.integers(len(items)))]
            return f"delete an element of {where}"
        if choice == 1:
            k = int(rng.integers(len(items)))
            if field.type == FD.TYPE_MESSAGE:
                items.add().CopyFrom(items[k])
            else:
                items.append(items[k])
            return f"duplicate an element of {where}"
        if choice == 2 and field.type != FD.TYPE_MESSAGE:
            items[int(rng.integers(len(items)))] = _value(field, rng, names)
            return f"change an element of {where}"
        if field.type == FD.TYPE_MESSAGE:
            items.add()
        else:
            items.append(_value(field, rng, names))
        return f"append to {where}"
    if field.type == FD.TYPE_MESSAGE:
        msg.ClearField(field.name)
        return f"clear {where}"
    try:
        setattr(msg, field.name, _value(field, rng, names))
    except (ValueError, TypeError):
        msg.ClearField(field.name)
        return f"clear {where}"
    return f"set {where}"


def mutate_bytes(data: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    """Flip, cut, duplicate or insert bytes of a serialized model."""
    b = bytearray(data)
    kind = int(rng.integers(4))
    if kind == 0:
        for _ in range(int(rng.integers(1, 5))):
            b[int(rng.integers(len(b)))] ^= 1 << int(rng.integers(8))
        return bytes(b), "flip bits"
    if kind == 1:
        return bytes(b[: int(rng.integers(len(b)))]), "truncate"
    i, j = sorted(int(v) for v in rng.integers(0, len(b), 2))
    if kind == 2:
        return bytes(b[:j] + b[i:j] + b[j:]), "duplicate a chunk"
    return bytes(b[:i] + bytes(rng.integers(0, 256, int(rng.integers(1, 9))).astype(np.uint8)) + b[i:]), "insert bytes"


def mutant(seeds: dict[str, tuple[onnx.ModelProto, bytes]], rng: np.random.Generator) -> tuple[str, bytes, str]:
    """``(seed name, mutant bytes, description)``: 3 in 4 mutants change 1-3 fields, the others bytes."""
    name = sorted(seeds)[int(rng.integers(len(seeds)))]
    model, data = seeds[name]
    if rng.random() < 0.75:
        m = onnx.ModelProto()
        m.CopyFrom(model)
        done = [mutate_field(m, rng) for _ in range(int(rng.integers(1, 4)))]
        with contextlib.suppress(Exception):  # a value protobuf will not serialize (bad UTF-8): mutate the bytes
            return name, m.SerializeToString(), "; ".join(done)
    data, done = mutate_bytes(data, rng)
    return name, data, done


# -------------------------------------------------------------------------------------------- execution


def _child(workdir: Path, result_path: Path) -> None:
    """Run the four commands on ``workdir/m.onnx`` (in this forked child) and write the findings as JSON."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    os.chdir(workdir)
    before = set(os.listdir("."))
    findings = {}
    for cmd, argv in COMMANDS.items():
        err_path = workdir.parent / f"{workdir.name}.{cmd}.err"
        fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        saved = os.dup(2), os.dup(1)
        os.dup2(fd, 2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        try:
            rc = main(list(argv))
        except BaseException as exc:  # noqa: BLE001 - main must not raise
            rc = f"raised {type(exc).__name__}: {exc}"
        finally:
            sys.stderr.flush()
            sys.stdout.flush()
            os.dup2(saved[0], 2)
            os.dup2(saved[1], 1)
            os.close(fd)
        err = err_path.read_text(errors="replace")
        err_path.unlink()
        left = sorted(set(os.listdir(".")) - before)
        problems = judge(cmd, rc, err, left)
        if problems:
            findings[cmd] = {"rc": rc, "stderr": err[-2000:], "left": left, "problems": problems}
        for f in left:  # each command starts from the same directory
            (Path(f).unlink() if Path(f).is_file() or Path(f).is_symlink() else shutil.rmtree(f))
    result_path.write_text(json.dumps(findings))


def judge(cmd: str, rc, err: str, left: list[str]) -> list[str]:
    """The problems of one command's outcome (exit code, stderr, files left in its directory); none: it passed."""
    problems = []
    allowed = (0, 1, 2) if cmd == "check" else (0, 2)
    if rc not in allowed:
        problems.append(f"exit {rc}")
    lines = err.splitlines()
    if "Traceback" in err:
        problems.append("traceback")
    told = lines[:-1] if rc == 2 else lines  # notes and warnings may come before a refusal's line
    if rc == 2 and (not lines or not lines[-1].startswith("revgraph: error: ")):
        problems.append("a refusal without its error line last")
    if rc in allowed and any(not ln.startswith(("note: ", "warning: ")) for ln in told):
        problems.append("stray stderr output (not one error line, note or warning)")
    expected = [OUTPUTS[cmd]] if rc == 0 and cmd in OUTPUTS else []
    if left != expected:
        problems.append(f"files left: {left} (expected {expected})")
    return problems


def forked(fn, timeout: float = TIMEOUT, memory_limit: int | None = None) -> str | None:
    """Run ``fn()`` in a forked child (under an address-space limit of ``memory_limit`` bytes when given);
    ``None`` when it exited 0, else what happened (``timeout after N s``, ``child died (signal N)``, ``child
    died (exit N)``). The fuzzers of models and of snapshots share it."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 0
        try:
            if memory_limit is not None:
                resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
            fn()
        except BaseException:  # noqa: BLE001 - the fuzzer records every failure
            code = 1
        os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return f"timeout after {timeout:.0f} s"
        time.sleep(0.01)
    if os.WIFSIGNALED(status):
        return f"child died (signal {os.WTERMSIG(status)})"
    return None if os.WEXITSTATUS(status) == 0 else f"child died (exit {os.WEXITSTATUS(status)})"


def run_mutant(data: bytes, extra: dict[str, bytes], root: Path) -> dict:
    """Fork a child that runs every command on the model ``data`` (with the files ``extra`` next to it)
    in a new directory under ``root``; its findings (``{}`` when all passed)."""
    workdir = Path(tempfile.mkdtemp(dir=root))
    (workdir / "m.onnx").write_bytes(data)
    for name, content in extra.items():
        (workdir / name).write_bytes(content)
    result = workdir.parent / f"{workdir.name}.json"
    died = forked(lambda: _child(workdir, result))
    if died is not None and died.startswith("timeout"):
        shutil.rmtree(workdir, ignore_errors=True)
        return {"all": {"problems": [died]}}
    try:
        findings = json.loads(result.read_text()) if result.exists() else {
            "all": {"problems": [died or "child died (exit 0)"]}}
    finally:
        result.unlink(missing_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)
    return findings


def fuzz(count: int, seed: int, save: Path | None = None, start: int = 0) -> list[dict]:
    """Run ``count`` mutants (numbers ``start`` .. ``start + count - 1`` of the stream of ``seed``); return
    the failures, each with its mutant saved under ``save`` (a reproducer) when given."""
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(prefix="revgraph-fuzz-") as tmp:
        root = Path(tmp)
        seeds_dir = root / "seeds"
        seeds_dir.mkdir()
        seeds = {k: (m, write_seed(m, seeds_dir)) for k, m in seed_models().items()}
        extra = {"w.data": (seeds_dir / "w.data").read_bytes()}
        failures = []
        for k in range(start + count):
            name, data, how = mutant(seeds, rng)
            if k < start:
                continue
            findings = run_mutant(data, extra if name == "external" else {}, root)
            if findings:
                failure = {"mutant": k, "seed_model": name, "mutation": how, "findings": findings}
                if save is not None:
                    save.mkdir(parents=True, exist_ok=True)
                    (save / f"mutant-{seed}-{k}.onnx").write_bytes(data)
                    if name == "external":
                        (save / "w.data").write_bytes(extra["w.data"])
                    failure["file"] = str(save / f"mutant-{seed}-{k}.onnx")
                failures.append(failure)
    return failures


def command_line(fuzz_fn, doc: str) -> None:
    """The command line of a fuzz kit: ``--count N --seed S [--start K] [--save DIR] [--json FILE]``; runs
    ``fuzz_fn(count, seed, save, start)``, prints the failures and exits 1 when there is one."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--save", type=Path)
    p.add_argument("--json", type=Path, help="write the failures here")
    a = p.parse_args()
    found = fuzz_fn(a.count, a.seed, a.save, a.start)
    if a.json:
        a.json.write_text(json.dumps(found, indent=1))
    for f in found:
        print(json.dumps(f)[:600])
    print(f"{len(found)} of {a.count} mutants failed")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    command_line(fuzz, __doc__)
