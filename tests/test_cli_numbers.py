"""Numbers from the command line (issue 28, part 6): every numeric option of every command is range-checked at
parse time (revgraph.cli.numeric), a bad value is one line naming the option (exit 2), and a demo size that
needs more memory than the machine has is refused with the figure.

The sweep walks every subparser of ``revgraph``'s parser: each option with a numeric type gets a huge integer,
a negative, zero, nan, inf, -inf, text and a float where an integer is meant, and must refuse or accept each as
this file's own table of kinds says (an option missing from the table fails, as does any ``type=int``)."""

from __future__ import annotations

import argparse
import math
import os
import re

import numpy as np
import pytest
from kit.harness import one_line_error

import revgraph as rg
from revgraph.cli import _parser, main
from revgraph.cli import numeric as cli_numbers
from revgraph.cli.numeric import Checked, Number
from revgraph.tools.demo import Settings, memory_needed, rnn_model
from revgraph.validate import INT64_MAX, gib, physical_memory

I64 = INT64_MAX


def _int_between(low, high):
    return lambda v: isinstance(v, int) and low <= v <= high


def _float_where(pred):
    return lambda v: isinstance(v, int | float) and math.isfinite(v) and pred(v)


POS_INT, NONNEG_INT, ANY_INT = _int_between(1, I64), _int_between(0, I64), _int_between(-(2**63), I64)
POS, NONNEG = _float_where(lambda v: v > 0), _float_where(lambda v: v >= 0)

#: What each numeric option accepts, written out here independently of revgraph.cli.numeric (a number read
#: from the command line: an int for digits, else a float).
KINDS = {
    "--seed": NONNEG_INT, "--epochs": POS_INT, "--hidden": POS_INT, "--batch-size": POS_INT,
    "--threads": _int_between(0, 4096), "--checkpoint-every": NONNEG_INT, "--nproc": _int_between(1, 1024),
    "--snapshot-every": NONNEG_INT, "--max-steps": POS_INT, "--eval-every": POS_INT, "--eval-batch-size": POS_INT,
    "--nnodes": _int_between(1, 65536), "--node-rank": _int_between(0, 65535), "--max-restarts": NONNEG_INT,
    "--accumulate-steps": POS_INT, "--warmup-steps": NONNEG_INT, "--growth-interval": POS_INT, "--lora": POS_INT,
    "--ignore-index": ANY_INT, "--opset": _int_between(7, __import__("onnx").defs.onnx_opset_version()),
    "--lr": POS, "--momentum": _float_where(lambda v: 0 <= v < 1), "--weight-decay": NONNEG, "--min-lr": NONNEG,
    "--clip-grad-norm": POS, "--rtol": NONNEG, "--atol": NONNEG,
    "--label-smoothing": _float_where(lambda v: 0 <= v <= 1),
    "--lora-alpha": _float_where(lambda v: v != 0), "--timeout": _float_where(lambda v: 0 < v <= 1e9),
    "--bucket-mb": _float_where(lambda v: 0 < v <= 2.0**43),
    "--init-scale": _float_where(lambda v: 0 < v <= 3.4028234663852886e38),
    "--growth-factor": _float_where(lambda v: 1 < v <= 3.4028234663852886e38),
    "--backoff-factor": _float_where(lambda v: 0 < v < 1),
}
SWEEP = ["100000000000000000000", "-1", "0", "nan", "inf", "-inf", "abc", "2.5", "1e400", "1"]
#: Metavariable words that say an option's value is a number: such an option must have a checked type.
NUMERIC_METAVARS = {"N", "K", "B", "T", "R", "M", "S", "F", "A", "H", "I", "C", "LR", "MB", "SECONDS", "RANK",
                    "WD", "BYTES", "PORT", "i"}


def _commands(parser: argparse.ArgumentParser, prefix=()):
    """``(command words, parser)`` of every leaf command (``lora extract`` included)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield prefix, parser
    for a in subs:
        for name, sub in a.choices.items():
            yield from _commands(sub, (*prefix, name))


COMMANDS = list(_commands(_parser()))


def _options():
    for words, p in COMMANDS:
        for a in p._actions:
            if a.option_strings and a.nargs != 0:
                yield words, p, a


def _valid_example(action) -> str:
    if isinstance(action.type, Number):
        for v in (1, 7, 2, 0.5, 0, 1.5):
            if action.type.problem(v) is None:
                return str(v)
    if action.choices:
        return str(next(iter(action.choices)))
    return {"--loss": "mse", "--loss-fn": "mse", "--checkpoint": "store"}.get(action.option_strings[-1], "x.onnx")


def _argv(words, parser, **replace) -> list[str]:
    """A command line that parses: ``words``, a value for every positional and every required option, with
    ``replace`` (option -> text) given as ``--option=text`` (so that ``-inf`` is a value, not an option)."""
    argv = list(words)
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction) or not (a.required or not a.option_strings):
            continue
        if not a.option_strings:
            argv.append("m.onnx")
        elif a.option_strings[-1] not in replace:
            argv += [a.option_strings[-1], _valid_example(a)]
    for option, text in replace.items():
        argv.append(f"{option}={text}")
    return argv


def _read(text: str):
    try:
        return int(text)
    except ValueError:
        return float(text) if re.fullmatch(r"[-+]?(nan|inf|[0-9.e+-]+)", text) else text


def test_every_numeric_option_has_a_checked_type():
    """No ``type=int`` or ``type=float`` anywhere, every typed option a :class:`Checked`, every option whose
    metavariable or default is a number typed, and every numeric option in this file's table of kinds."""
    seen = set()
    for words, _, a in _options():
        where = f"{' '.join(words)} {a.option_strings[-1]}"
        if a.type is not None:
            assert isinstance(a.type, Checked), f"{where}: type={a.type!r} is not range-checked (revgraph.cli.numeric)"
        if isinstance(a.type, Number):
            assert a.option_strings[-1] in KINDS, f"{where}: add the option's kind to KINDS"
            seen.add(a.option_strings[-1])
            if a.default is not None:
                assert a.type.problem(a.default) is None and KINDS[a.option_strings[-1]](a.default), where
        elif a.type is None and not a.choices:
            words_of = set(re.split(r"[^A-Za-z]+", str(a.metavar or "")))
            assert not words_of & NUMERIC_METAVARS, f"{where}: metavar {a.metavar!r} is a number; give it a type"
            assert a.default is None or (isinstance(a.default, str | list) and not isinstance(a.default, bool)), where
    assert seen == set(KINDS), set(KINDS) - seen  # (the table names no option that is gone)


CASES = [(words, a.option_strings[-1], text) for words, _, a in _options() if isinstance(a.type, Number)
         for text in SWEEP]


@pytest.mark.parametrize("words,option,text", CASES, ids=[f"{' '.join(w)} {o}={t}" for w, o, t in CASES])
def test_numeric_options_refuse_or_accept_at_parse_time(words, option, text, capsys, tmp_path, monkeypatch):
    """Each value is refused in one line naming the option (exit 2, nothing written) or accepted by the parser,
    as KINDS says; never a traceback or exit 3."""
    monkeypatch.chdir(tmp_path)
    parser = dict(COMMANDS)[words]
    argv = _argv(words, parser, **{option: text})
    value = _read(text)
    if KINDS[option](value):
        ns = _parser().parse_args(argv)
        assert getattr(ns, parser._option_string_actions[option].dest) == value
    else:
        code = main(argv)
        one_line_error(code, capsys.readouterr().err, f"argument {option}", repr(text))
        assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("option", ["--checkpoint", "--memory-budget", "--device", "--rdzv-endpoint"])
def test_options_holding_a_number_are_checked_where_they_are_read(option, capsys):
    """The options whose text holds a number: K of --checkpoint, the byte count of --memory-budget, the index of
    --device cuda:i, the port of --rdzv-endpoint: huge or odd values are usage errors naming the option."""
    bad = {"--checkpoint": ["99999999999999999999", str(2**62 + 1), "0", "-3", "2.5", "１２"],
           "--memory-budget": ["1e400GB", str(10**20), "nan", "-1", "1.5"],
           "--device": ["cuda:99999999999999999999", "cuda:-1", "cuda:１"],
           "--rdzv-endpoint": ["h:99999999999999999999", "h:0", "h:²", "h:-1"]}[option]
    for words, p, a in _options():
        if a.option_strings[-1] != option:
            continue
        for text in bad:
            code = main(_argv(words, p, **{option: text}))
            one_line_error(code, capsys.readouterr().err, f"argument {option}")


def test_every_command_with_a_numeric_option_is_swept():
    """The sweep reaches the commands that have numeric options (a walk that found none would pass vacuously)."""
    swept = {" ".join(w) for w, _, _ in CASES}
    assert {"run", "check", "grad", "jvp", "hvp", "jacobian", "hessian", "train", "demo"} <= swept, swept


@pytest.fixture(scope="module")
def loop_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("numbers") / "loop.onnx"
    rg.save(rnn_model(hidden=3), path)
    return str(path)


def test_a_huge_checkpoint_interval_is_a_usage_error(loop_model, capsys, tmp_path):
    """The issue's example: ``grad --checkpoint 99999999999999999999`` on a model with a Loop was an
    OverflowError, exit 3."""
    out = tmp_path / "g.onnx"
    code = main(["grad", loop_model, "-o", str(out), "--checkpoint", "99999999999999999999"])
    one_line_error(code, capsys.readouterr().err, "argument --checkpoint", "99999999999999999999", "2**62")
    assert not out.exists()


def test_the_largest_checkpoint_interval_gives_the_right_gradient(loop_model):
    """K = 2**62, the largest accepted, gives the gradient of the stored policy; K = 2**63 - 1 (accepted before)
    wrapped ceil(T / K) around in int64 and gave another gradient without an error."""
    g = rg.load(loop_model)
    x = np.random.default_rng(0).random((3, 8, 8), dtype=np.float32)
    ref = rg.Session(rg.gradient(g)).run({"x": x})
    got = rg.Session(rg.gradient(g, checkpoint=2**62)).run({"x": x})
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-6, atol=1e-7, err_msg=k)
    with pytest.raises(rg.RevgraphError, match="2\\*\\*62"):
        rg.gradient(g, checkpoint=2**63 - 1)


def test_demo_refuses_a_size_beyond_the_machine_with_the_figure(capsys, tmp_path):
    """``demo --hidden 100000`` was a MemoryError (74.5 GiB for one float64 draw of the recurrent matrix), exit
    3: refused before anything is allocated or written, with what it needs and what the machine has."""
    have = physical_memory()
    assert have and have > 2**28
    out = tmp_path / "demo"
    code = main(["demo", "--hidden", "100000", "-o", str(out)])
    needed = memory_needed(Settings(hidden=100000))
    assert needed >= 8 * 100000**2  # at least the float64 draw of U that failed
    one_line_error(code, capsys.readouterr().err, "--hidden 100000", f"needs {gib(needed)}",
                   f"this machine has {gib(have)}")
    assert not out.exists()
    # the smallest hidden size beyond this machine, too (the figure follows the size)
    h = math.isqrt(have // 16) + 1
    assert memory_needed(Settings(hidden=h)) > have
    code = main(["demo", "--hidden", str(h), "-o", str(out)])
    one_line_error(code, capsys.readouterr().err, f"--hidden {h}", "needs", "this machine has")
    assert not out.exists()


def test_the_issue_examples_in_a_subprocess(loop_model, tmp_path):
    """The two examples as a user runs them: exit 2 and one line, no traceback."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(rg.__file__)),
                                                        os.environ.get("PYTHONPATH", "")])}
    for argv, fragment in ((["grad", loop_model, "-o", str(tmp_path / "g.onnx"), "--checkpoint",
                              "99999999999999999999"], "argument --checkpoint"),
                            (["demo", "--hidden", "100000", "-o", str(tmp_path / "d")], "--hidden 100000 needs")):
        done = subprocess.run([sys.executable, "-m", "revgraph", *argv], capture_output=True, text=True, env=env,
                              timeout=120)
        one_line_error(done.returncode, done.stderr, fragment)
    assert not list(tmp_path.iterdir())


def test_number_types_describe_their_bounds():
    """The refusal says what to give, with the bounds (the stated maxima among them)."""
    with pytest.raises(argparse.ArgumentTypeError, match="from 0 to 4096"):
        cli_numbers.THREADS("5000")
    with pytest.raises(argparse.ArgumentTypeError, match="not a whole number; give a whole number from 1 to "
                       f"{I64}"):
        cli_numbers.POSITIVE_INT("1e3")
    with pytest.raises(argparse.ArgumentTypeError, match=r"not finite; give a number in \[0, 1\)"):
        cli_numbers.MOMENTUM("inf")
