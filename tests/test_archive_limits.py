"""Issue 28, part 3 (archives): an ``.npz`` given to a command is read member by member, only the members the
command needs, each bounded by its declared size before it is decompressed (revgraph/onnx_io/archive.py).

The bomb: a 3 MB ``.npz`` whose member ``.npy`` header declares 3 GiB of float32 zeros, and whose deflate stream
really holds them (a valid archive: the zip's sizes and CRC are those of the 3 GiB). ``np.load`` allocated and
decompressed it in full, used or not. Every command that reads an ``.npz`` (``run --inputs``, ``check
--inputs``, ``train --data``, ``--test-data``, ``--static NAME=FILE.npz:member``, ``lora apply ADAPTERS.npz``)
and every one that reads an ``.npy`` whole (``--static NAME=FILE.npy``, ``--class-weights``) is run in a fresh
process under an address-space limit: it either succeeds (the bomb is a member it does not need) or exits 2
with one line naming the member and the bound, and its peak memory stays that of a tiny run.
"""

from __future__ import annotations

import functools
import struct
import zipfile
import zlib

import numpy as np
import onnx
import pytest
from kit.harness import cli_under_limit, one_line_error
from onnx import TensorProto, helper, numpy_helper

from revgraph.cli import main
from revgraph.errors import InputError
from revgraph.onnx_io import archive

#: The bomb's declared shape: 268435456 x 3 float32 = 3 GiB.
BOMB_SHAPE = (1 << 28, 3)
BOMB_BYTES = BOMB_SHAPE[0] * BOMB_SHAPE[1] * 4
#: Peak resident memory (MiB) a command may reach with the bomb in its input: what a tiny run takes (about
#: 90 MiB for train, measured) plus a wide margin, far below the bomb's 3 GiB (3163 MiB before the fix).
PEAK_MB = 600
#: The address space each command gets: enough for a tiny run (torch reserves much address space), too little
#: for the bomb's 3 GiB beside it.
ADDRESS_SPACE = 3 << 30


def npy_header(shape, dtype=np.float32) -> bytes:
    """The ``.npy`` (format 1.0) header of an array of ``shape`` and ``dtype``."""
    import io

    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                             "fortran_order": False, "shape": tuple(shape)})
    return f.getvalue()


@functools.cache
def _bomb_stream() -> tuple[bytes, int]:
    """The deflate stream of the bomb member (its .npy header, then 3 GiB of zeros) and its CRC-32, made once
    (the CRC of 3 GiB takes seconds). Every zero chunk after a full flush compresses alike: the stream is the
    header's part, one zero chunk's bytes repeated, and an empty final block."""
    header = npy_header(BOMB_SHAPE)
    chunk_bytes = 1 << 24
    zeros = bytes(chunk_bytes)
    first = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = first.compress(header) + first.flush(zlib.Z_FULL_FLUSH)
    again = zlib.compressobj(9, zlib.DEFLATED, -15)
    chunk = again.compress(zeros) + again.flush(zlib.Z_FULL_FLUSH)
    n = BOMB_BYTES // chunk_bytes
    crc = zlib.crc32(header)
    for _ in range(n):  # the CRC of what the member really holds, so that the archive is valid
        crc = zlib.crc32(zeros, crc)
    return head + chunk * n + b"\x03\x00", crc


def bomb(tmp_path, member: str, arrays: dict[str, np.ndarray], name: str = "b.npz"):
    """An ``.npz`` at ``tmp_path / name`` whose member ``member`` is a real deflated float32 array of
    :data:`BOMB_SHAPE` zeros (3 GiB declared and held; about 3 MB on disk), plus the ordinary members
    ``arrays``."""
    path = tmp_path / name
    data, crc = _bomb_stream()
    fname = (member + ".npy").encode()
    usize = len(npy_header(BOMB_SHAPE)) + BOMB_BYTES
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 8, 0, 0x21, crc, len(data), usize, len(fname), 0) + fname
    central = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 8, 0, 0x21, crc, len(data), usize,
                          len(fname), 0, 0, 0, 0, 0, 0) + fname
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, len(central), len(local) + len(data), 0)
    path.write_bytes(local + data + central + end)
    with zipfile.ZipFile(path, "a") as zf:  # the ordinary members, appended
        for k, a in arrays.items():
            with zf.open(k + ".npy", "w") as f:
                np.lib.format.write_array(f, a)
    return path


def model(path, static_input: bool = False, fixed: bool = False) -> str:
    """``y = x @ W (+ s)``: x float32 [N, 3] ([2, 3] when ``fixed``), W [3, 2], s float32 [2] (a static input)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2 if fixed else "N", 3])
    w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(3, 2) / 6, "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h" if static_input else "y"], name="mm")]
    inputs = [x]
    if static_input:
        nodes.append(helper.make_node("Add", ["h", "s"], ["y"], name="add"))
        inputs.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, [2]))
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2 if fixed else "N", 2])
    g = helper.make_graph(nodes, "g", inputs, [out], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    onnx.save(m, str(path))
    return str(path)


X = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
LABELS = np.ones((4, 2), np.float32)


def test_the_bomb_is_what_the_issue_says(tmp_path):
    """A 3 MB file declaring 3 GiB, a valid archive: the zip records the 3 GiB and numpy reads the header."""
    path = bomb(tmp_path, "junk", {"x": X})
    assert path.stat().st_size < 4 << 20
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("junk.npy")
        assert info.file_size == len(npy_header(BOMB_SHAPE)) + BOMB_BYTES
        with zf.open(info) as f:  # the stream really holds zeros, and decompresses
            assert f.read(1 << 20)[len(npy_header(BOMB_SHAPE)):].count(0) == (1 << 20) - len(npy_header(BOMB_SHAPE))
    with zipfile.ZipFile(path) as zf:
        shape, dtype, _ = archive.member_header(zf, zf.getinfo("junk.npy"), "b.npz", "junk")
    assert shape == BOMB_SHAPE and dtype == np.float32


def _train(m, *extra):
    return ("train", m, "--loss", "mse", "--epochs", "1", "--batch-size", "2", *extra)


#: (command builder, bomb member, the outcome): every command that reads an .npz, the bomb as a member it does
#: not need (success, or exit 2 naming it unread) and as one it needs (exit 2 naming the bound)
CASES = {
    "run --inputs, unused member": (lambda t, m, z: ("run", m, "--inputs", z, "-o", t / "o.npz"), "junk",
                                    {"x": X}, (2, "'junk': the graph has no such input")),
    "run --inputs, used member": (lambda t, m, z: ("run", m, "--inputs", z, "-o", t / "o.npz"), "x", {},
                                  (2, "member 'x' declares float32[268435456, 3], 3.0 GiB, over the limit")),
    "check --inputs, unused member": (lambda t, m, z: ("check", m, "--inputs", z), "junk", {"x": X},
                                      (2, "'junk': the graph has no such input")),
    "check --inputs, used member": (lambda t, m, z: ("check", m, "--inputs", z), "x", {},
                                    (2, "member 'x' declares float32[268435456, 3], 3.0 GiB, over the limit")),
    "train --data, unused member": (lambda t, m, z: _train(m, "--data", z, "-o", t / "t.onnx"), "junk",
                                    {"x": X, "labels": LABELS}, (0, "")),
    "train --data, used member x": (lambda t, m, z: _train(m, "--data", z, "-o", t / "t.onnx"), "x",
                                    {"labels": LABELS}, (2, "member 'x' declares 268,435,456 samples but 'labels' 4")),
    "train --data, used member labels": (lambda t, m, z: _train(m, "--data", z, "-o", t / "t.onnx"), "labels",
                                         {"x": X}, (2, "member 'labels' declares 268,435,456 samples but 'x' 4")),
    "train --test-data, unused member": (
        lambda t, m, z: _train(m, "--data", z, "--test-data", z, "-o", t / "t.onnx"), "junk",
        {"x": X, "labels": LABELS}, (0, "")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_command_reading_an_npz_bounds_its_members(tmp_path, case):
    build, member, arrays, (code, needle) = CASES[case]
    m = model(tmp_path / "m.onnx")
    z = bomb(tmp_path, member, arrays)
    got, peak, _, err = cli_under_limit(*build(tmp_path, m, z), address_space=ADDRESS_SPACE)
    if code == 0:
        assert got == 0, err
        assert (tmp_path / "t.onnx").is_file()
    else:
        one_line_error(got, err, repr(str(z)), needle)
        assert not (tmp_path / "o.npz").exists() and not (tmp_path / "t.onnx").exists()
    assert 0 < peak < PEAK_MB, (peak, err)


def test_static_npz_member_reads_only_that_member(tmp_path):
    """``--static s=FILE.npz:s`` decompresses ``s`` alone (the bomb beside it is never read), and a bomb as ``s``
    is refused against the model's declared [2] before it is read."""
    m = model(tmp_path / "m.onnx", static_input=True)
    data = tmp_path / "d.npz"
    np.savez(data, x=X, labels=LABELS)
    z = bomb(tmp_path, "junk", {"s": np.array([0.5, -0.5], np.float32)})
    code, peak, _, err = cli_under_limit(*_train(m, "--data", data, "--static", f"s={z}:s", "-o", tmp_path / "t.onnx"),
                                         address_space=ADDRESS_SPACE)
    assert code == 0, err
    assert 0 < peak < PEAK_MB
    z2 = bomb(tmp_path, "s", {}, name="b2.npz")
    code, peak, _, err = cli_under_limit(*_train(m, "--data", data, "--static", f"s={z2}:s", "-o", tmp_path / "u.onnx"),
                                         address_space=ADDRESS_SPACE)
    one_line_error(code, err, "member 's' declares shape [268435456, 3]; the model declares [2] for it")
    assert 0 < peak < PEAK_MB and not (tmp_path / "u.onnx").exists()


def test_lora_apply_bounds_every_member(tmp_path):
    """``lora apply`` reads every member (all are adapters): each is bounded, the bomb refused unread."""
    m = model(tmp_path / "m.onnx")
    z = bomb(tmp_path, "lora_A", {})
    code, peak, _, err = cli_under_limit("lora", "apply", m, z, "-o", tmp_path / "o.onnx", address_space=ADDRESS_SPACE)
    one_line_error(code, err, "member 'lora_A' declares float32[268435456, 3], 3.0 GiB, over the limit")
    assert 0 < peak < PEAK_MB and not (tmp_path / "o.onnx").exists()


def test_a_static_input_fixes_the_members_shape(tmp_path):
    """A fully declared input ([2, 3]) bounds its member exactly: another shape is refused from the header."""
    m = model(tmp_path / "m.onnx", fixed=True)
    z = tmp_path / "z.npz"
    np.savez(z, x=np.zeros((3, 3), np.float32))
    code = main(["run", m, "--inputs", str(z)])
    assert code == 2
    np.savez(z, x=X[:2])
    assert main(["run", m, "--inputs", str(z), "-o", str(tmp_path / "o.npz")]) == 0
    assert np.array_equal(np.load(tmp_path / "o.npz")["y"], X[:2] @ (np.arange(6, dtype=np.float32).reshape(3, 2) / 6))


def forged(path, member: str, arrays=None) -> None:
    """An ``.npz`` whose member ``member`` declares 3 GiB in its header and holds 12 bytes (the zip agrees:
    a truncated or forged member)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member + ".npy", npy_header(BOMB_SHAPE) + bytes(12))
        for k, a in (arrays or {}).items():
            with zf.open(k + ".npy", "w") as f:
                np.lib.format.write_array(f, a)


def test_a_forged_member_is_refused_before_allocation(tmp_path, capsys):
    m = model(tmp_path / "m.onnx")
    z = tmp_path / "f.npz"
    forged(z, "x")
    code = main(["run", m, "--inputs", str(z), "-o", str(tmp_path / "o.npz")])
    one_line_error(code, capsys.readouterr().err, "member 'x' declares float32[268435456, 3]",
                   "archive holds 12 bytes of it; the file is truncated or forged")
    assert not (tmp_path / "o.npz").exists()


def test_members_not_needed_are_never_decompressed(tmp_path):
    """An unused member whose deflate stream is garbage: reading it would fail; the read succeeds."""
    z = tmp_path / "g.npz"
    with zipfile.ZipFile(z, "w", zipfile.ZIP_DEFLATED) as zf:
        with zf.open("x.npy", "w") as f:
            np.lib.format.write_array(f, X)
        zf.writestr("junk.npy", npy_header((4,)) + bytes(16))
    raw = bytearray(z.read_bytes())
    at = raw.index(b"junk.npy") + len(b"junk.npy")  # the local header's name, then the compressed bytes
    raw[at:at + 8] = b"\xff" * 8
    z.write_bytes(bytes(raw))
    got = archive.read_archive(z, {"x": (None, 3)})
    assert list(got) == ["x"] and np.array_equal(got["x"], X)
    with pytest.raises(InputError, match="member 'junk'"):
        archive.read_archive(z)  # read: it is refused in one line


def test_the_limit_applies_where_the_model_leaves_dimensions_open(tmp_path, monkeypatch):
    """The stated limit (2 GiB; lowered here) bounds members whose declared shape has a symbolic dimension, not
    one the model fixes in full."""
    z = tmp_path / "a.npz"
    np.savez(z, x=np.zeros((100, 3), np.float32))
    monkeypatch.setattr(archive, "MAX_MEMBER_BYTES", 1000)
    with pytest.raises(InputError,
                       match=r"member 'x' declares float32\[100, 3\], 1.2 KiB, over the limit of 1000 bytes"):
        archive.read_archive(z, {"x": ("N", 3)})
    assert archive.read_archive(z, {"x": (100, 3)})["x"].shape == (100, 3)  # fixed by the model: its size


def test_an_object_member_is_refused_unread(tmp_path):
    z = tmp_path / "o.npz"
    np.savez(z, x=np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(InputError, match="member 'x' holds an array of Python objects"):
        archive.read_archive(z)


@pytest.mark.parametrize("option", ["--static", "--class-weights", "--data-dir"])
def test_npy_files_declaring_more_than_they_hold(tmp_path, option):
    """``.npy`` files read whole (``--static s=FILE.npy``, ``--class-weights``) or memory-mapped (``--data
    DIR``) whose header declares 3 GiB and which hold 12 bytes: refused from the header, nothing allocated."""
    m = model(tmp_path / "m.onnx", static_input=True)
    bad = tmp_path / "bad.npy"
    bad.write_bytes(npy_header(BOMB_SHAPE) + bytes(12))
    data = tmp_path / "d.npz"
    np.savez(data, x=X, labels=LABELS)
    args = {"--static": ["--data", data, "--static", f"s={bad}"],
            "--class-weights": ["--data", data, "--static", f"s={tmp_path / 's.npy'}", "--class-weights", bad],
            "--data-dir": ["--data", tmp_path / "dir", "--static", f"s={tmp_path / 's.npy'}"]}[option]
    np.save(tmp_path / "s.npy", np.zeros(2, np.float32))
    (tmp_path / "dir").mkdir()
    np.save(tmp_path / "dir" / "labels.npy", LABELS)
    (tmp_path / "dir" / "x.npy").write_bytes(bad.read_bytes())
    code, peak, _, err = cli_under_limit(*_train(m, *args, "-o", tmp_path / "t.onnx"), address_space=ADDRESS_SPACE)
    one_line_error(code, err, "declares float32[268435456, 3] (3,221,225,472 bytes) but holds 12 bytes of data")
    assert 0 < peak < PEAK_MB and not (tmp_path / "t.onnx").exists()


@pytest.mark.parametrize("option", ["--data", "--test-data"])
def test_data_members_must_agree_on_the_samples_before_any_is_read(tmp_path, option, monkeypatch):
    """A ``labels`` member declaring 2^20 rows beside an ``x`` of 4, under the 2 GiB member limit (a 4.7 MB
    archive declaring 1 GiB of labels was decompressed, then cast to int64 past the memory limit: exit 3): the
    headers disagree on the number of samples, refused before any member is decompressed."""
    m = model(tmp_path / "m.onnx")
    np.savez(tmp_path / "ok.npz", x=X, labels=LABELS)
    np.savez_compressed(tmp_path / "d.npz", x=X, labels=np.zeros((1 << 20, 2), np.float32))
    read = []
    real = archive._read_member
    monkeypatch.setattr(archive, "_read_member", lambda *a: read.append(a[2]) or real(*a))
    data = ["--data", str(tmp_path / "d.npz")] if option == "--data" else \
        ["--data", str(tmp_path / "ok.npz"), "--test-data", str(tmp_path / "d.npz")]
    code = main(list(map(str, _train(m, *data, "-o", tmp_path / "t.onnx"))))
    assert code == 2 and not (tmp_path / "t.onnx").exists()
    assert read.count("labels") == (1 if option == "--test-data" else 0)  # (ok.npz's own labels only)
