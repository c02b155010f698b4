"""Issue 28 round 3: ``revgraph lora apply`` given an adapters file with a bad member (wrong dtype, wrong shape,
not an array, missing) said "the model's metadata" or "(KeyError)", or applied it silently (an int64 or bool
adapter was cast). Every kind of bad member, in both adapter formats (``.npz`` members and ``.onnx``
initializers) and the configuration's own members, is a one-line refusal naming the file, the member and what
is wrong, from the command line (exit 2, nothing written) and from ``lora.load_adapters`` / ``lora.apply``."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest
from kit.harness import one_line_error
from kit.lora import ALPHA, RANK, mixed_model, run
from onnx import numpy_helper as nh

import revgraph as rg
from revgraph.cli import main
from revgraph.train import lora

F32 = np.float32
A = "W1.lora_A"  # an adapter: float32 [8, 4]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """``base.onnx``, the adapted model with a non-zero B, and its adapters as ``ad.npz`` and ``ad.onnx``."""
    d = tmp_path_factory.mktemp("lora")
    base = mixed_model()
    rg.save(base, d / "base.onnx")
    g = lora.add_adapters(base, RANK, alpha=ALPHA)
    rng = np.random.default_rng(3)
    for n in lora.adapter_names(g):
        g.initializers[n] = rng.normal(0, 0.3, g.initializers[n].shape).astype(F32)
    rg.save(g, d / "trained.onnx")
    for suffix in (".npz", ".onnx"):
        lora.save_adapters(d / f"ad{suffix}", g)
    return d, g


def members(d) -> dict[str, np.ndarray]:
    with np.load(d / "ad.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def shape_of(d, name):
    return members(d)[name].shape


NPZ_CASES = {  # name: (change the members in place, what the message says after the member)
    "int64": (lambda m: m.update({A: m[A].astype(np.int64)}),
              f"member {A!r} (the A adapter of weight 'W1') has dtype int64"),
    "bool": (lambda m: m.update({A: m[A] > 0}), "has dtype bool"),
    "string": (lambda m: m.update({A: np.array("hello")}), "has dtype <U5"),
    "complex": (lambda m: m.update({A: m[A].astype(np.complex64)}), "has dtype complex64"),
    "scalar": (lambda m: m.update({A: np.array(1.5, F32)}), "has shape []; an adapter is a 2-D array"),
    "3-d": (lambda m: m.update({A: m[A][None]}), "has shape [1, 8, 4]; an adapter is a 2-D array"),
    "wrong shape": (lambda m: m.update({A: m[A][:, :2]}),
                    "has shape [8, 2]; weight 'W1' of the base model needs [8, 4]"),
    "transposed": (lambda m: m.update({A: m[A].T.copy()}), "has shape [4, 8]; weight 'W1' of the base model needs"),
    "nan": (lambda m: m.update({A: np.where(m[A] > 0, np.nan, m[A]).astype(F32)}), "holds NaN or infinite values"),
    "inf": (lambda m: m.update({A: np.full_like(m[A], np.inf)}), "holds NaN or infinite values"),
    "missing, listed": (lambda m: m.pop(A), f"member {A!r} is missing (member 'revgraph_names' lists it"),
    "missing": (lambda m: (m.pop(A), m.pop("revgraph_names")),
                f"member {A!r} (the A adapter of weight 'W1') is missing"),
    "no configuration, listed": (lambda m: m.pop("revgraph.lora"), "member 'revgraph.lora' is missing (member"),
    "no configuration": (lambda m: (m.pop("revgraph.lora"), m.pop("revgraph_names")),
                         "holds no LoRA configuration (member 'revgraph.lora')"),
    "configuration not JSON": (lambda m: m.update({"revgraph.lora": np.array("{bad")}),
                               "member 'revgraph.lora' is not a LoRA configuration revgraph wrote"),
    "configuration a list": (lambda m: m.update({"revgraph.lora": np.array("[1, 2]")}),
                             "member 'revgraph.lora' is not a LoRA configuration revgraph wrote"),
    "configuration numbers": (lambda m: m.update({"revgraph.lora": np.zeros(3)}),
                              "member 'revgraph.lora' is a float64 array of shape [3], not the JSON text"),
    "names numbers": (lambda m: m.update({"revgraph_names": np.zeros((3, 2))}),
                      "member 'revgraph_names' is a float64 array of shape [3, 2], not the table"),
    "names one column": (lambda m: m.update({"revgraph_names": m["revgraph_names"][:, :1]}),
                         "member 'revgraph_names' is a <U"),
}


@pytest.mark.parametrize("case", list(NPZ_CASES))
def test_a_bad_npz_member_is_named(adapters, tmp_path, capsys, case):
    d, _ = adapters
    m = members(d)
    NPZ_CASES[case][0](m)
    bad = tmp_path / "bad.npz"
    np.savez(bad, **m)
    fragment = NPZ_CASES[case][1]
    for merge in ([], ["--merge"]):
        code = main(["lora", "apply", str(d / "base.onnx"), str(bad), "-o", str(tmp_path / "o.onnx"), *merge])
        err = capsys.readouterr().err
        one_line_error(code, err, f"{str(bad)!r}: ", fragment)
        assert "the model's metadata" not in err and "Error)" not in err
        assert not (tmp_path / "o.onnx").exists()


@pytest.mark.parametrize("case", ["int64", "wrong shape", "nan", "missing", "configuration not JSON"])
def test_load_adapters_and_apply_name_the_file_and_member(adapters, tmp_path, case):
    """The Python API says the same: load_adapters checks what it can alone, apply(source=) the shapes."""
    d, _ = adapters
    m = members(d)
    NPZ_CASES[case][0](m)
    bad = tmp_path / "bad.npz"
    np.savez(bad, **m)
    with pytest.raises(rg.RevgraphError) as err:
        arrays, c = lora.load_adapters(bad)
        lora.apply(mixed_model(), arrays, c, source=bad)
    assert f"{str(bad)!r}: " in str(err.value) and NPZ_CASES[case][1] in str(err.value), str(err.value)


def test_apply_given_arrays_in_python_names_the_adapter(adapters):
    _, g = adapters
    arrays, c = lora.extract(g)
    for value, fragment in [([[1.0] * 4] * 8, f"adapter {A!r} (the A adapter of weight 'W1') is a list, not an array"),
                            (np.zeros((8, 4), np.int32), "has dtype int32"),
                            (np.zeros((8, 5), F32), "has shape [8, 5]; weight 'W1' of the base model needs [8, 4]")]:
        with pytest.raises(rg.RevgraphError, match=re.escape(fragment)):
            lora.apply(mixed_model(), {**arrays, A: value}, c)
    rest = {k: v for k, v in arrays.items() if k != A}
    with pytest.raises(rg.RevgraphError, match=f"adapter '{A}' .* is missing; the adapters hold 'W1.lora_B'"):
        lora.apply(mixed_model(), rest, c)


ONNX_CASES = {
    "int64": (lambda a: a.astype(np.int64), f"initializer {A!r} (the A adapter of weight 'W1') has dtype int64"),
    "wrong shape": (lambda a: a[:, :2], "has shape [8, 2]; weight 'W1' of the base model needs [8, 4]"),
    "nan": (lambda a: np.full_like(a, np.nan), "holds NaN or infinite values"),
    "missing": (None, f"initializer {A!r} (the A adapter of weight 'W1') is missing"),
}


@pytest.mark.parametrize("case", list(ONNX_CASES))
def test_a_bad_onnx_adapter_is_named(adapters, tmp_path, capsys, case):
    """The same kinds in the .onnx form (the adapters as initializers, the configuration as metadata)."""
    d, _ = adapters
    model = onnx.load(d / "ad.onnx")
    init = next(t for t in model.graph.initializer if t.name == A)
    change, fragment = ONNX_CASES[case]
    model.graph.initializer.remove(init)
    out = next(o for o in model.graph.output if o.name == A)
    model.graph.output.remove(out)
    if change is not None:
        value = change(nh.to_array(init))
        model.graph.initializer.append(nh.from_array(value, A))
        model.graph.output.append(onnx.helper.make_tensor_value_info(
            A, onnx.helper.np_dtype_to_tensor_dtype(value.dtype), list(value.shape)))
    bad = tmp_path / "bad.onnx"
    onnx.save(model, bad)
    code = main(["lora", "apply", str(d / "base.onnx"), str(bad), "-o", str(tmp_path / "o.onnx")])
    one_line_error(code, capsys.readouterr().err, f"{str(bad)!r}: ", fragment)
    assert not (tmp_path / "o.onnx").exists()


def test_a_bad_configuration_in_onnx_metadata_names_the_file(adapters, tmp_path, capsys):
    d, _ = adapters
    model = onnx.load(d / "ad.onnx")
    for p in model.metadata_props:
        if p.key == "revgraph.lora":
            p.value = json.dumps({"format": 1, "adapters": [{"weight": 3}]})
    bad = tmp_path / "bad.onnx"
    onnx.save(model, bad)
    code = main(["lora", "apply", str(d / "base.onnx"), str(bad), "-o", str(tmp_path / "o.onnx")])
    one_line_error(code, capsys.readouterr().err, f"{str(bad)!r}: metadata 'revgraph.lora' is not a LoRA configuration")


@pytest.mark.parametrize("suffix", [".npz", ".onnx"])
def test_good_files_still_apply_and_a_float64_adapter_is_cast(adapters, tmp_path, suffix):
    """The checks refuse only bad members: both formats apply to the trained model's outputs, and float64
    adapters (another float precision) apply cast to the weight's dtype."""
    d, g = adapters
    x = np.random.default_rng(0).normal(0, 1, (5, 8)).astype(F32)
    want = run(g, x, False)
    assert main(["lora", "apply", str(d / "base.onnx"), str(d / f"ad{suffix}"), "-o", str(tmp_path / "o.onnx")]) == 0
    np.testing.assert_array_equal(run(rg.load(tmp_path / "o.onnx"), x, False), want)
    m = members(d)
    m = {k: v.astype(np.float64) if k.endswith(("lora_A", "lora_B")) else v for k, v in m.items()}
    np.savez(tmp_path / "f64.npz", **m)
    arrays, c = lora.load_adapters(tmp_path / "f64.npz")
    np.testing.assert_array_equal(run(lora.apply(mixed_model(), arrays, c), x, False), want)
