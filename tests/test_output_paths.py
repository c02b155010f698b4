"""Issue 28, part 2 (and the writing items of part 7): writing where it cannot be written.

Every command that writes a file (``run -o``, ``grad``, ``jvp``, ``hvp``, ``jacobian``, ``hessian``, ``show``,
``train -o`` / ``--save-training-graph`` / ``--checkpoint-dir``, ``lora extract`` / ``apply``, ``demo -o``) x
every kind of output path: a new file, an existing 0600 file, a symbolic link to a file, a dangling link, a
character device, a FIFO with a reader, standard output, a directory, a missing directory, a name over
NAME_MAX, a name of 245 characters, a full disk (a 64 KiB tmpfs) or a file-size limit, a read-only directory.
Each asserts the exit code, the one error line, the files left in the directory (no temporary file), that a
device is still a device and a FIFO still a FIFO, and the mode. Commands run in this process through
``revgraph.cli.main``, except where the process's own standard output or resource limits are the subject.
"""

from __future__ import annotations

import io
import os
import socket
import stat
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from kit.harness import char_device, fill_disk, mount_tmpfs, one_line_error, umount

import revgraph as rg
from revgraph.cli import main
from revgraph.ir import Graph, Node, ValueInfo
from revgraph.onnx_io import atomic
from revgraph.train import lora
from revgraph.train.trainer import Trainer

ROOT = os.geteuid() == 0
SRC = str(Path(rg.__file__).resolve().parents[1])
UMASK = os.umask(0)
os.umask(UMASK)


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")


def _model() -> Graph:
    rng = np.random.default_rng(0)
    return Graph([Node("MatMul", ["x", "W"], ["logits"], name="mm")], [ValueInfo("x", np.float32, ("N", 2))],
                 [ValueInfo("logits", np.float32, ("N", 3))], {"W": rng.standard_normal((2, 3)).astype(np.float32)})


def _scalar_model() -> Graph:
    return Graph([Node("Mul", ["x", "x"], ["s"], name="sq"),
                  Node("ReduceSum", ["s"], ["y"], {"keepdims": 0}, name="r")],
                 [ValueInfo("x", np.float32, (3,))], [ValueInfo("y", np.float32, ())])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """The commands' input files, in a directory of their own (the output directories stay clean)."""
    d = tmp_path_factory.mktemp("inputs")
    rng = np.random.default_rng(0)
    rg.save(_model(), d / "m.onnx")
    rg.save(_scalar_model(), d / "s.onnx")
    np.savez(d / "d.npz", x=rng.standard_normal((8, 2)).astype(np.float32), labels=rng.integers(0, 3, 8))
    np.savez(d / "in.npz", x=rng.standard_normal((2, 2)).astype(np.float32))
    adapted = lora.add_adapters(_model(), 1, alpha=1.0)
    rg.save(adapted, d / "lora.onnx")
    lora.save_adapters(d / "adapters.npz", adapted)
    return d


def _commands(i: Path) -> dict[str, tuple[str, object]]:
    """Command name -> (suffix of its output, argv builder taking the output path)."""
    train = ["train", str(i / "m.onnx"), "--data", str(i / "d.npz"), "--loss", "cross-entropy", "--epochs", "1",
             "--batch-size", "4"]
    return {
        "run": (".npz", lambda o: ["run", str(i / "m.onnx"), "--inputs", str(i / "in.npz"), "-o", o]),
        "grad": (".onnx", lambda o: ["grad", str(i / "m.onnx"), "-o", o]),
        "jvp": (".onnx", lambda o: ["jvp", str(i / "m.onnx"), "-o", o]),
        "hvp": (".onnx", lambda o: ["hvp", str(i / "s.onnx"), "-o", o]),
        "jacobian": (".onnx", lambda o: ["jacobian", str(i / "s.onnx"), "-o", o]),
        "hessian": (".onnx", lambda o: ["hessian", str(i / "s.onnx"), "-o", o]),
        "show": (".dot", lambda o: ["show", str(i / "m.onnx"), "-o", o]),
        "train -o": (".onnx", lambda o: [*train, "-o", o]),
        "train --save-training-graph": (".onnx", lambda o: [*train, "-o", str(i / "trained.onnx"),
                                                            "--save-training-graph", o]),
        "lora extract .npz": (".npz", lambda o: ["lora", "extract", str(i / "lora.onnx"), "-o", o]),
        "lora extract .onnx": (".onnx", lambda o: ["lora", "extract", str(i / "lora.onnx"), "-o", o]),
        "lora apply": (".onnx", lambda o: ["lora", "apply", str(i / "m.onnx"), str(i / "adapters.npz"), "-o", o]),
    }


COMMANDS = list(_commands(Path(".")))


def _parses(data: bytes, suffix: str) -> None:
    """``data`` is a whole file of its kind (what a reader of a FIFO or a device gets)."""
    assert data, "nothing written"
    if suffix == ".onnx":
        onnx.checker.check_model(onnx.load_from_string(data))
    elif suffix == ".npz":
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            assert z.namelist()
    else:
        assert data.startswith(b"digraph"), data[:40]


def _listing(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


# ----------------------------------------------------------------------------------- the sweep, in process

KINDS = ["new", "existing 0600", "symlink to a file", "dangling symlink", "character device", "fifo with a reader",
         "directory", "missing directory", "name over NAME_MAX", "245-character name", "full disk",
         "read-only directory"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_and_output_kind(inputs, tmp_path, capsys, command, kind):
    suffix, argv = _commands(inputs)[command]
    d = tmp_path / "out"
    d.mkdir()
    out = d / ("out" + suffix)
    mounted = None
    reader = None
    got: dict[str, bytes] = {}
    if kind == "existing 0600":
        out.write_bytes(b"old")
        os.chmod(out, 0o600)
    elif kind == "symlink to a file":
        (d / ("real" + suffix)).write_bytes(b"old")
        os.chmod(d / ("real" + suffix), 0o640)
        os.symlink("real" + suffix, out)
    elif kind == "dangling symlink":
        os.symlink("nowhere" + suffix, out)
    elif kind == "character device":
        out = char_device(d, "null" + suffix, 3)
    elif kind == "fifo with a reader":
        os.mkfifo(out)

        def read():
            with open(out, "rb") as f:
                got["data"] = f.read()
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
    elif kind == "directory":
        out.mkdir()
    elif kind == "missing directory":
        out = d / "missing" / ("out" + suffix)
    elif kind == "name over NAME_MAX":
        out = d / ("x" * 300 + suffix)
    elif kind == "245-character name":
        out = d / ("y" * (245 - len(suffix)) + suffix)
    elif kind == "read-only directory" and not ROOT:  # (root writes in a 0500 directory: a read-only mount)
        out.write_bytes(b"old")
        os.chmod(d, 0o500)
    elif kind in ("full disk", "read-only directory"):
        mounted = tmp_path / "mnt"
        if not mount_tmpfs(mounted):
            pytest.skip("needs root to mount a tmpfs (the file-size limit case runs without it)")
        d = mounted
        out = d / ("out" + suffix)
    try:
        if mounted is not None:
            out.write_bytes(b"old")
            if kind == "full disk":
                fill_disk(d)
            else:
                subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True, timeout=20)
        before = _listing(d)
        code = main(argv(str(out)))
        if reader is not None:
            reader.join(20)
            assert not reader.is_alive(), "the FIFO's reader never saw the end of the file"
        captured = capsys.readouterr()
        listing = _listing(d)
        if mounted is not None or kind == "read-only directory":
            assert out.read_bytes() == b"old"  # the previous file intact
    finally:
        if kind == "read-only directory" and not ROOT:
            os.chmod(d, 0o700)
        if mounted is not None:
            umount(mounted)
    if kind in ("new", "existing 0600", "symlink to a file", "245-character name"):
        assert code == 0, captured.err
        assert listing == before | {out.name}, listing  # no temporary file left
        written = out.resolve()
        assert written.is_file()
        _parses(written.read_bytes(), suffix)
        mode = {"new": 0o666 & ~UMASK, "existing 0600": 0o600, "symlink to a file": 0o640,
                "245-character name": 0o666 & ~UMASK}[kind]
        assert stat.S_IMODE(written.stat().st_mode) == mode
        if kind == "symlink to a file":
            assert out.is_symlink() and os.readlink(out) == "real" + suffix  # the link is kept, its target replaced
    elif kind == "character device":
        assert code == 0, captured.err
        assert stat.S_ISCHR(os.lstat(out).st_mode)  # still the device, not a regular file in its place
        assert listing == before
    elif kind == "fifo with a reader":
        assert code == 0, captured.err
        assert stat.S_ISFIFO(os.lstat(out).st_mode)
        _parses(got["data"], suffix)
        assert listing == before
    else:
        fragment = {"dangling symlink": "which does not exist", "directory": "is a directory",
                    "missing directory": "does not exist", "name over NAME_MAX": "ENAMETOOLONG",
                    "full disk": "no space left on the device writing", "read-only directory": "is not writable"}[kind]
        one_line_error(code, captured.err, fragment)
        assert listing == before, listing  # nothing half-written, no temporary file
        if kind == "dangling symlink":
            assert os.readlink(out) == "nowhere" + suffix


@pytest.mark.parametrize("command", ["grad", "run", "train -o", "lora extract .npz"])
def test_a_full_disk_leaves_the_old_file(inputs, tmp_path, capsys, command):
    suffix, argv = _commands(inputs)[command]
    mnt = tmp_path / "mnt"
    if not mount_tmpfs(mnt):
        pytest.skip("needs root to mount a tmpfs (the file-size limit case runs without it)")
    try:
        out = mnt / ("out" + suffix)
        out.write_bytes(b"old")
        os.chmod(out, 0o600)
        fill_disk(mnt)
        code = main(argv(str(out)))
        one_line_error(code, capsys.readouterr().err, f"no space left on the device writing {str(out)!r}",
                       "left as it was")
        assert out.read_bytes() == b"old" and stat.S_IMODE(out.stat().st_mode) == 0o600
        assert _listing(mnt) == {out.name, "filler"}
    finally:
        umount(mnt)


def test_a_full_character_device(inputs, tmp_path, capsys):
    for command in ("grad", "run", "show"):
        suffix, argv = _commands(inputs)[command]
        full = char_device(tmp_path, "full" + suffix, 7) if ROOT else Path("/dev/full")
        if not ROOT and suffix == ".dot":
            continue  # (show needs the .dot suffix; without root no other device can be made)
        one_line_error(main(argv(str(full))), capsys.readouterr().err,
                       f"no space left on the device writing {str(full)!r}")
        assert stat.S_ISCHR(os.lstat(full).st_mode)


def test_a_fifo_without_a_reader_is_refused_after_a_wait(inputs, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(atomic, "FIFO_WAIT", 0.2)
    os.mkfifo(tmp_path / "f.onnx")
    one_line_error(main(["grad", str(inputs / "m.onnx"), "-o", str(tmp_path / "f.onnx")]), capsys.readouterr().err,
                   "no process opened the FIFO for reading")
    assert stat.S_ISFIFO(os.lstat(tmp_path / "f.onnx").st_mode) and _listing(tmp_path) == {"f.onnx"}


def test_sockets_and_loops_are_refused(inputs, tmp_path, capsys):
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(tmp_path / "s.onnx"))
        one_line_error(main(["grad", str(inputs / "m.onnx"), "-o", str(tmp_path / "s.onnx")]), capsys.readouterr().err,
                       "is a socket")
        assert stat.S_ISSOCK(os.lstat(tmp_path / "s.onnx").st_mode)
    finally:
        sock.close()
    os.symlink("b.onnx", tmp_path / "a.onnx")
    os.symlink("a.onnx", tmp_path / "b.onnx")
    one_line_error(main(["grad", str(inputs / "m.onnx"), "-o", str(tmp_path / "a.onnx")]), capsys.readouterr().err,
                   "loop of symbolic links")


def test_a_read_only_file_is_not_replaced(inputs, tmp_path, capsys, monkeypatch):
    out = tmp_path / "g.onnx"
    out.write_bytes(b"old")
    os.chmod(out, 0o444)
    if ROOT:  # root may write any file: the access check answers as for another user
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(out) else real(p, mode))
    one_line_error(main(["grad", str(inputs / "m.onnx"), "-o", str(out)]), capsys.readouterr().err, "read-only")
    assert out.read_bytes() == b"old"


@pytest.mark.skipif(not ROOT, reason="making another user's link needs root")
def test_another_users_link_in_a_sticky_directory_is_not_followed(inputs, tmp_path, capsys):
    shared = tmp_path / "shared"  # as /tmp: world-writable and sticky
    shared.mkdir()
    os.chmod(shared, 0o1777)
    victim = tmp_path / "victim.onnx"
    victim.write_bytes(b"mine")
    os.symlink(victim, shared / "out.onnx")
    os.lchown(shared / "out.onnx", 4242, 4242)
    one_line_error(main(["grad", str(inputs / "m.onnx"), "-o", str(shared / "out.onnx")]), capsys.readouterr().err,
                   "symbolic link of another user (uid 4242)")
    assert victim.read_bytes() == b"mine"
    os.lchown(shared / "out.onnx", 0, 0)  # our own link is followed: its target replaced
    assert main(["grad", str(inputs / "m.onnx"), "-o", str(shared / "out.onnx")]) == 0
    assert (shared / "out.onnx").is_symlink() and victim.read_bytes() != b"mine"


@pytest.mark.skipif(not ROOT, reason="chown to another user needs root")
def test_the_owner_of_a_replaced_file_is_kept(inputs, tmp_path):
    out = tmp_path / "g.onnx"
    out.write_bytes(b"old")
    os.chown(out, 4242, 4343)
    os.chmod(out, 0o640)
    assert main(["grad", str(inputs / "m.onnx"), "-o", str(out)]) == 0
    st = out.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (4242, 4343, 0o640)


# -------------------------------------------------------------------------- pairs of paths, before any work


@pytest.mark.parametrize("extra, fragments", [
    (["-o", "X", "--checkpoint-dir", "X"], ["-o 'X' would be a file where the checkpoint file", "needs a directory"]),
    (["-o", "t.onnx", "--save-training-graph", "t.onnx.data"], ["is where the external data of -o"]),
    (["-o", "t.onnx", "--save-training-graph", "g.onnx", "--checkpoint-dir", "g.onnx"], ["is not a directory"]),
    (["-o", "ck/t.onnx", "--checkpoint-dir", "ck"], ["does not exist"]),
])
def test_train_checks_every_pair_of_outputs_before_training(inputs, tmp_path, capsys, monkeypatch, extra, fragments):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "g.onnx").write_bytes(b"old")
    argv = ["train", str(inputs / "m.onnx"), "--data", str(inputs / "d.npz"), "--loss", "cross-entropy",
            "--epochs", "1", *extra]
    one_line_error(main(argv), capsys.readouterr().err, *fragments)
    assert _listing(tmp_path) == {"g.onnx"} and (tmp_path / "g.onnx").read_bytes() == b"old"  # nothing trained


def test_an_output_whose_external_data_would_be_an_input(inputs, tmp_path, capsys):
    data = tmp_path / "t.onnx.data"
    data.write_bytes((inputs / "d.npz").read_bytes())
    before = data.read_bytes()
    argv = ["train", str(inputs / "m.onnx"), "--data", str(data), "--loss", "cross-entropy", "--epochs", "1",
            "-o", str(tmp_path / "t.onnx")]
    one_line_error(main(argv), capsys.readouterr().err, "--data", "is where the external data of -o")
    adapters = tmp_path / "a.onnx.data"
    adapters.write_bytes((inputs / "adapters.npz").read_bytes())
    one_line_error(main(["lora", "apply", str(inputs / "m.onnx"), str(adapters), "-o", str(tmp_path / "a.onnx")]),
                   capsys.readouterr().err, "ADAPTERS", "is where the external data of -o")
    assert data.read_bytes() == before and _listing(tmp_path) == {"t.onnx.data", "a.onnx.data"}


@pytest.mark.parametrize("how", ["name", "dotdot", "hard link", "symlink", "test data", "static", "weights"])
@pytest.mark.parametrize("flag", ["-o", "--save-training-graph"])
def test_no_output_replaces_a_file_train_reads(inputs, tmp_path, capsys, monkeypatch, flag, how):
    # issue 40: train --data DIR -o DIR/x.npy exited 0 after replacing the training data with the trained model;
    # every file train reads (each .npy of a data directory, --test-data's, --static, --class-weights) is
    # compared with every output, by device and inode (links, "..") as by name
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    for d in ("data", "test"):
        (tmp_path / d).mkdir()
        np.save(tmp_path / d / "x.npy", rng.standard_normal((8, 2)).astype(np.float32))
        np.save(tmp_path / d / "labels.npy", rng.integers(0, 3, 8))
    np.save(tmp_path / "w.npy", np.ones(3, np.float32))
    target = {"name": "data/x.npy", "dotdot": "test/../data/labels.npy", "hard link": "hard.onnx",
              "symlink": "sym.onnx", "test data": "test/x.npy", "static": "w.npy", "weights": "w.npy"}[how]
    if how == "hard link":
        os.link(tmp_path / "data" / "labels.npy", tmp_path / "hard.onnx")
    if how == "symlink":
        os.symlink(tmp_path / "data" / "x.npy", tmp_path / "sym.onnx")
    extra = {"test data": ["--test-data", "test"], "static": ["--static", "unused=w.npy"],
             "weights": ["--class-weights", "w.npy"]}.get(how, [])
    argv = ["train", str(inputs / "m.onnx"), "--data", "data", "--loss", "cross-entropy", "--epochs", "1", *extra,
            *(["-o", target] if flag == "-o" else ["-o", "trained.onnx", flag, target])]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*.npy")}
    code = main(argv)
    one_line_error(code, capsys.readouterr().err, f"{flag} {target!r} is the same file as",
                   "writing it would destroy that file")
    assert {p: p.read_bytes() for p in tmp_path.rglob("*.npy")} == before
    assert not (tmp_path / "trained.onnx").exists()


def test_the_checkpoint_must_be_a_regular_file(inputs, tmp_path, capsys):
    ck = tmp_path / "ck"
    ck.mkdir()
    os.mkfifo(ck / "checkpoint.npz")
    argv = ["train", str(inputs / "m.onnx"), "--data", str(inputs / "d.npz"), "--loss", "cross-entropy",
            "--epochs", "1", "-o", str(tmp_path / "t.onnx"), "--checkpoint-dir", str(ck)]
    one_line_error(main(argv), capsys.readouterr().err, "the checkpoint file", "must be a regular file")
    assert not (tmp_path / "t.onnx").exists()


# ------------------------------------------------- standard output, rlimits: the process's own, subprocesses


def _cli(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC, "COLUMNS": "250"}
    return subprocess.run([sys.executable, "-m", "revgraph", *args], check=False, env=env, timeout=120, **kwargs)


SLOW = pytest.mark.slow  # (a subprocess each: a fast sample runs by default, the rest with -m slow)


@pytest.mark.parametrize("command", ["grad", "run", *(pytest.param(c, marks=SLOW) for c in
                                                      ("show", "train -o", "lora extract .npz"))])
@pytest.mark.parametrize("via", ["/dev/stdout", "a link to /proc/self/fd/1"])
def test_output_to_standard_output(inputs, tmp_path, command, via):
    suffix, argv = _commands(inputs)[command]
    out = "/dev/stdout"
    if via != "/dev/stdout":
        out = str(tmp_path / ("link" + suffix))
        os.symlink("/proc/self/fd/1", out)
    p = _cli(argv(out), capture_output=True)
    if out == "/dev/stdout" and command in ("show", "lora extract .npz"):  # the format is the name's suffix:
        one_line_error(p.returncode, p.stderr.decode(), "/dev/stdout")  # a link named FILE.dot can point there
        return
    assert p.returncode == 0, p.stderr
    _parses(p.stdout, suffix)  # the file alone: the report lines went to stderr
    assert b"wrote" in p.stderr
    if via != "/dev/stdout":
        assert os.readlink(out) == "/proc/self/fd/1" and _listing(tmp_path) == {"link" + suffix}


@pytest.mark.parametrize("command", ["grad", "info", *(pytest.param(c, marks=SLOW) for c in ("run", "train", "demo"))])
def test_standard_output_on_a_full_device(inputs, tmp_path, command):
    argv = {"grad": ["grad", str(inputs / "m.onnx"), "-o", str(tmp_path / "g.onnx")],
            "info": ["info", str(inputs / "m.onnx")],
            "run": ["run", str(inputs / "m.onnx"), "--inputs", str(inputs / "in.npz")],
            "train": ["train", str(inputs / "m.onnx"), "--data", str(inputs / "d.npz"), "--loss", "cross-entropy",
                      "--epochs", "1", "-o", str(tmp_path / "t.onnx")],
            "demo": ["demo", "-o", str(tmp_path / "demo"), "--quick", "--epochs", "1", "--hidden", "4"]}[command]
    with open("/dev/full", "w") as full:
        p = _cli(argv, stdout=full, stderr=subprocess.PIPE, text=True)
    one_line_error(p.returncode, p.stderr, "no space left on the device writing standard output")


_LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
from revgraph.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", ["grad", "run", *(pytest.param(c, marks=SLOW) for c in
                                                      ("show", "train -o", "lora extract .onnx"))])
def test_a_file_size_limit(inputs, tmp_path, command):
    big = tmp_path.parent / f"{tmp_path.name}-big.onnx"  # a model whose outputs pass 2 KiB
    n = 1000
    rg.save(Graph([Node("Mul", ["x", "W"], ["logits"], name="mul")], [ValueInfo("x", np.float32, ("N", n))],
                  [ValueInfo("logits", np.float32, ("N", n))], {"W": np.ones(n, np.float32)}), big)
    np.savez(tmp_path.parent / f"{tmp_path.name}-big.npz", x=np.ones((2, n), np.float32))
    suffix, argv = _commands(inputs)[command]
    args = argv(str(tmp_path / ("out" + suffix)))
    if command != "lora extract .onnx":
        args = [str(big) if a == str(inputs / "m.onnx") else a for a in args]
        args = [str(tmp_path.parent / f"{tmp_path.name}-big.npz") if a == str(inputs / "in.npz") else a for a in args]
    if command == "show":  # a chain of 60 nodes: a DOT text over the limit
        chain = Graph([Node("Relu", [f"v{k}"], [f"v{k + 1}"], name=f"relu{k}") for k in range(60)],
                      [ValueInfo("v0", np.float32, (2,))], [ValueInfo("v60", np.float32, (2,))])
        rg.save(chain, big)
    if command == "train -o":
        np.savez(tmp_path.parent / f"{tmp_path.name}-d.npz", x=np.ones((4, n), np.float32),
                 y=np.ones((4, n), np.float32))
        args = ["train", str(big), "--data", str(tmp_path.parent / f"{tmp_path.name}-d.npz"), "--loss", "mse",
                "--epochs", "1", "-o", str(tmp_path / "out.onnx")]
    if command == "lora extract .onnx":
        adapted = lora.add_adapters(Graph([Node("MatMul", ["x", "W"], ["y"], name="mm")],
                                          [ValueInfo("x", np.float32, ("N", 64))],
                                          [ValueInfo("y", np.float32, ("N", 64))],
                                          {"W": np.ones((64, 64), np.float32)}), 8, alpha=1.0)
        rg.save(adapted, tmp_path.parent / f"{tmp_path.name}-lora.onnx")
        args[2] = str(tmp_path.parent / f"{tmp_path.name}-lora.onnx")
    (tmp_path / ("out" + suffix)).write_bytes(b"old")
    env = {**os.environ, "PYTHONPATH": SRC, "COLUMNS": "250"}
    p = subprocess.run([sys.executable, "-c", _LIMITED, *args], check=False, env=env, capture_output=True, text=True,
                       timeout=120)
    one_line_error(p.returncode, p.stderr, "file size limit exceeded writing", "left as it was")
    assert (tmp_path / ("out" + suffix)).read_bytes() == b"old" and _listing(tmp_path) == {"out" + suffix}


# ---------------------------------------------------------------------------------------- the Python API


def _api_writers() -> dict:
    """Each public writer of the Python API: name -> (the suffix its path needs, write(path))."""
    from revgraph.tools import viz
    from revgraph.train import sgd

    g = _model()
    trainer = Trainer(g, "cross-entropy", sgd(lr=0.1))
    adapted = lora.add_adapters(g, 1)
    return {
        "rg.save": ("", lambda p: rg.save(g, p)),
        "Trainer.export": ("", trainer.export),
        "Trainer.save_training_graph": ("", trainer.save_training_graph),
        "viz.show": (".dot", lambda p: viz.show(g, p)),
        "lora.save_adapters": (".npz", lambda p: lora.save_adapters(p, adapted)),
    }


@pytest.mark.parametrize("kind", ["over-long name", "NUL", "directory", "dangling symlink", "device"])
def test_python_api_writers(tmp_path, kind):
    for name, (suffix, write) in _api_writers().items():
        d = tmp_path / name
        d.mkdir()
        if kind == "device":
            if not ROOT and suffix:
                continue  # (the system's /dev/null has no suffix; without root no other device can be made)
            target = char_device(d, "null" + suffix, 3)
            write(target)
            assert stat.S_ISCHR(os.lstat(target).st_mode), name
            continue
        target = {"over-long name": d / ("x" * 300 + suffix), "NUL": str(d / "a\x00b") + suffix,
                  "directory": d / ("sub" + suffix), "dangling symlink": d / ("link" + suffix)}[kind]
        if kind == "directory":
            os.mkdir(target)
        if kind == "dangling symlink":
            os.symlink("nowhere", target)
        with pytest.raises(rg.RevgraphError) as info:
            write(target)
        assert "\n" not in str(info.value), name
        assert {p.name for p in d.iterdir()} <= {"link" + suffix, "sub" + suffix}, name


def test_rg_save_examples(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(rg.RevgraphError, match="ENAMETOOLONG"):
        rg.save(_model(), "x" * 300)
    rg.save(_model(), "y" * 245)  # the temporary name is short: the whole NAME_MAX is the user's
    null = char_device(tmp_path, "null", 3)
    rg.save(_model(), null)
    assert stat.S_ISCHR(os.lstat(null).st_mode)
    assert _listing(tmp_path) == {"y" * 245, *(["null"] if ROOT else [])}


def test_checkpoint_dir_kinds(inputs, tmp_path, capsys):
    """--checkpoint-dir: made with its parents, its checkpoint keeps its mode when a resumed run rewrites it,
    and a read-only or full file system is refused (read-only before training) in one line."""
    base = ["train", str(inputs / "m.onnx"), "--data", str(inputs / "d.npz"), "--loss", "cross-entropy",
            "--batch-size", "4", "-o", str(tmp_path / "t.onnx")]
    ck = tmp_path / "a" / "b"
    assert main([*base, "--epochs", "1", "--checkpoint-dir", str(ck)]) == 0
    assert _listing(ck) == {"checkpoint.npz"}
    os.chmod(ck / "checkpoint.npz", 0o600)
    assert main([*base, "--epochs", "2", "--checkpoint-dir", str(ck)]) == 0
    assert "resumed" in capsys.readouterr().out
    assert stat.S_IMODE((ck / "checkpoint.npz").stat().st_mode) == 0o600 and _listing(ck) == {"checkpoint.npz"}
    mnt = tmp_path / "mnt"
    if not mount_tmpfs(mnt):
        return
    try:
        fill_disk(mnt)
        one_line_error(main([*base, "--epochs", "1", "--checkpoint-dir", str(mnt / "ck")]), capsys.readouterr().err,
                       "no space left on the device writing")
        assert not os.path.exists(mnt / "ck" / "checkpoint.npz") and _listing(mnt / "ck") == set()
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True, timeout=20)
        one_line_error(main([*base, "--epochs", "1", "--checkpoint-dir", str(mnt / "new" / "ck")]),
                       capsys.readouterr().err, "the checkpoint file", "is not writable")
        assert "steps of" not in capsys.readouterr().out
    finally:
        umount(mnt)


def test_two_outputs_may_both_go_to_dev_null(inputs, tmp_path, capsys, monkeypatch):
    null = char_device(tmp_path, "null", 3)  # (as root, a private /dev/null: a regression cannot replace the real one)
    monkeypatch.setattr(os, "devnull", str(null))
    argv = ["train", str(inputs / "m.onnx"), "--data", str(inputs / "d.npz"), "--loss", "cross-entropy",
            "--epochs", "1", "-o", str(null), "--save-training-graph", str(null)]
    assert main(argv) == 0, capsys.readouterr().err
    assert stat.S_ISCHR(os.lstat(null).st_mode)
    argv[-1] = argv[-3] = str(tmp_path / "t.onnx")  # a file twice stays refused
    one_line_error(main(argv), capsys.readouterr().err, "name the same file")


def test_a_large_model_through_a_link_or_into_a_device(tmp_path, monkeypatch):
    """A model over the (lowered) protobuf limit is two files: through a symbolic link both go next to the
    link's target (the model's data location names the file written); a FIFO or device cannot hold two files."""
    from revgraph.onnx_io import external_data

    monkeypatch.setattr(external_data, "PROTOBUF_LIMIT", 20_000)
    g = Graph([Node("Mul", ["x", "w"], ["y"], name="mul")], [ValueInfo("x", np.float32, (8192,))],
              [ValueInfo("y", np.float32, (8192,))], {"w": np.arange(8192, dtype=np.float32)})
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "m.onnx").write_bytes(b"old")
    os.symlink("real/m.onnx", tmp_path / "link.onnx")
    rg.save(g, tmp_path / "link.onnx")
    assert _listing(tmp_path) == {"real", "link.onnx"} and _listing(tmp_path / "real") == {"m.onnx", "m.onnx.data"}
    back = rg.load(tmp_path / "real" / "m.onnx")  # (through the link its data would be looked for next to the link)
    np.testing.assert_array_equal(back.initializers["w"], g.initializers["w"])
    null = char_device(tmp_path, "null", 3)
    with pytest.raises(rg.RevgraphError, match="written as two files"):
        rg.save(g, null)
    assert stat.S_ISCHR(os.lstat(null).st_mode)


def test_dev_stdout_when_standard_output_is_a_file(inputs, tmp_path):
    """``grad -o /dev/stdout > FILE``: /dev/stdout leads to a regular file, which is replaced as any file is
    (FILE holds the whole model, the report line went to stderr)."""
    with open(tmp_path / "g.onnx", "wb") as f:
        p = _cli(["grad", str(inputs / "m.onnx"), "-o", "/dev/stdout"], stdout=f, stderr=subprocess.PIPE, text=True)
    assert p.returncode == 0 and "wrote /dev/stdout" in p.stderr, p.stderr
    _parses((tmp_path / "g.onnx").read_bytes(), ".onnx")
    assert _listing(tmp_path) == {"g.onnx"}
