"""A model's LoRA configuration (``metadata["revgraph.lora"]``) is untrusted input, checked field by field (issue
40, item 2; src/revgraph/train/lora_config.py). A configuration naming ``b`` as both adapters made ``train`` and
``lora extract`` exit 3 (``KeyError``, the .npz left behind); one naming the base weight as an adapter made the
Trainer train the base weight; a site naming nothing gave a graph onnxruntime refused. Here: those cases from the
command line (exit 2, one line, nothing written), and a fuzz that replaces or deletes every field of a real
configuration, through ``lora.config``, ``merge_adapters``, ``extract`` and the ``Trainer``: each mutation is
refused in one line or, where it changes nothing that matters, trains the adapters alone."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from kit.harness import one_line_error
from kit.lora import mixed_model

import revgraph as rg
from revgraph.cli import main
from revgraph.errors import RevgraphError
from revgraph.train import lora

KEY = "revgraph.lora"
F32 = np.float32


@pytest.fixture(scope="module")
def adapted() -> rg.Graph:
    return lora.add_adapters(mixed_model(), 2, alpha=4.0, targets=["W1", "W2"])


def _with(g: rg.Graph, found) -> rg.Graph:
    g = g.copy()
    g.metadata[KEY] = found if isinstance(found, str) else json.dumps(found)
    return g


def _data(n: int = 8) -> dict:
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(n, 8)).astype(F32), "labels": rng.integers(0, 6, n)}


ISSUE_CASES = {
    "both adapters named b": lambda c: {"format": 1, "adapters": [{"weight": "W1", "A": "b2", "B": "b2"}]},
    "A is the base weight": lambda c: _set(c, ("adapters", 0, "A"), "W1"),
    "A is another weight": lambda c: _set(c, ("adapters", 0, "A"), "W4"),
    "a site naming nothing": lambda c: _set(c, ("adapters", 0, "sites", 0, "added"), ["no such node"]),
}


def _set(c: dict, path: tuple, value):
    c = copy.deepcopy(c)
    *head, last = path
    target = c
    for k in head:
        target = target[k]
    target[last] = value
    return c


@pytest.mark.parametrize("case", list(ISSUE_CASES))
def test_the_issues_configurations_are_refused_everywhere(adapted, tmp_path, capsys, case):
    bad = _with(adapted, ISSUE_CASES[case](json.loads(adapted.metadata[KEY])))
    rg.save(bad, tmp_path / "bad.onnx")
    np.savez(tmp_path / "d.npz", **_data())
    train = ["train", str(tmp_path / "bad.onnx"), "--data", str(tmp_path / "d.npz"), "--loss", "cross-entropy",
             "--epochs", "1", "-o", str(tmp_path / "t.onnx")]
    for argv in (train, [*train, "--merge-adapters"],
                 ["lora", "extract", str(tmp_path / "bad.onnx"), "-o", str(tmp_path / "a.npz")]):
        one_line_error(main(argv), capsys.readouterr().err, "metadata 'revgraph.lora' is not a LoRA configuration")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.onnx", "d.npz"]  # nothing written, nothing left
    for call in (lora.config, lora.merge_adapters, lora.extract, lambda g: rg.Trainer(g, "cross-entropy", "adam")):
        with pytest.raises(RevgraphError, match="is not a LoRA configuration revgraph wrote") as info:
            call(bad)
        assert "\n" not in str(info.value)


def _paths(value, prefix=()):
    """Every path into the JSON tree ``value`` (dict keys and list positions), leaves and inner nodes."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


REPLACEMENTS = [None, "", "W1", "W2.lora_A", "b2", 0, -1, 2, 1.5, float("nan"), True, [], {}, [1], "x" * 3]


def _get(c, path: tuple):
    for k in path:
        c = c[k]
    return c


def _mutations(c: dict):
    for path in list(_paths(c))[1:]:
        old = _get(c, path)
        for value in REPLACEMENTS:
            if type(value) is not type(old) or value != old:  # (not the value it has)
                yield path, repr(value), _set(c, path, value)
        *head, last = path
        c2 = copy.deepcopy(c)
        target = c2
        for k in head:
            target = target[k]
        del target[last]
        yield path, "deleted", c2


def test_every_field_mutated_is_refused_or_harmless(adapted):
    """The fuzz: for every field of the configuration, each replacement (and the field deleted). A mutation may
    be accepted only where the configuration still tells the truth about what it names (a seed, the targets'
    record, an adapter left out of the list, which then stays part of the model): the merged model computes
    what the adapted model computes, and the Trainer trains adapters only, never a base weight."""
    base = json.loads(adapted.metadata[KEY])
    rng = np.random.default_rng(1)
    for n in lora.adapter_names(adapted):  # non-zero B: a merge that drops an update shows in the outputs
        adapted.initializers[n] = rng.normal(0, 0.3, adapted.initializers[n].shape).astype(F32)
    x = _data()["x"]
    want = rg.Session(adapted).run({"x": x})["y"]
    adapters = set(lora.adapter_names(adapted))
    accepted, total = [], 0
    for path, what, found in _mutations(base):
        total += 1
        g = _with(adapted, json.dumps(found, allow_nan=True))
        try:
            lora.config(g)
        except RevgraphError as exc:
            assert "\n" not in str(exc) and "is not a LoRA configuration revgraph wrote" in str(exc), (path, what)
            continue
        except Exception as exc:  # noqa: BLE001 (the point: nothing but a one-line refusal)
            pytest.fail(f"{path} = {what}: {type(exc).__name__}: {exc}")
        accepted.append((path, what))
        got = rg.Session(lora.merge_adapters(g)).run({"x": x})["y"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{path} = {what}")
        tr = rg.Trainer(g, "cross-entropy", "sgd")
        assert set(tr.parameters) <= adapters, (path, what, sorted(tr.parameters))
    assert total > 300
    # accepted: a seed or a targets' record changed (neither is read after adapters exist), the scaling 2.0
    # written 2, a whole adapter left out of the list (it stays in the model), the scaling's Constant left out
    # of the added nodes (a merge leaves it, read by nothing)
    harmless = {(("scaling",), "2"), (("adapters", 0), "deleted"), (("adapters", 1), "deleted"),
                (("adapters", 0, "sites", 0, "added", 2), "deleted")}
    odd = [(p, w) for p, w in accepted if p[0] not in ("seed", "targets") and (p, w) not in harmless]
    assert not odd, odd


@pytest.mark.parametrize("seed", ["abc", [1], -1, 1.5, True])
@pytest.mark.parametrize("suffix", [".npz", ".onnx"])
def test_an_adapter_file_with_a_bad_seed_is_refused(adapted, tmp_path, capsys, suffix, seed):
    # issue 40, item 3: lora apply exited 3 on a seed of "abc" or [1] (an unguarded int())
    import onnx

    path = tmp_path / f"ad{suffix}"
    lora.save_adapters(path, adapted)
    found = json.loads(adapted.metadata[KEY]) | {"seed": seed}
    if suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            members = {k: z[k] for k in z.files}
        key = next(k for k, v in members.items() if v.dtype.kind == "U" and v.ndim == 0)
        members[key] = np.array(json.dumps(found))
        np.savez(path, **members)
    else:
        model = onnx.load(path)
        next(p for p in model.metadata_props if p.key == KEY).value = json.dumps(found)
        onnx.save(model, path)
    rg.save(mixed_model(), tmp_path / "base.onnx")
    code = main(["lora", "apply", str(tmp_path / "base.onnx"), str(path), "-o", str(tmp_path / "out.onnx")])
    one_line_error(code, capsys.readouterr().err, f"its seed {seed!r} is not an integer >= 0")
    assert not (tmp_path / "out.onnx").exists()
