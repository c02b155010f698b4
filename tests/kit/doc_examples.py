"""Running the code blocks of the README and docs/ with sybil (issue 44, item 3): the parsers, the evaluators
and the files each page's blocks expect (its fixtures).

sybil finds the blocks (its markdown lexers) and honours its skip directive, ``<!-- skip: next "why" -->`` or
``<!-- skip: start if(cond, reason="why") -->`` ... ``<!-- skip: end -->``; the evaluators here say what running
a block means:

- ``python``: executed in the page's namespace (sybil's own ``PythonEvaluator``), in the page's working
  directory; a block whose first line is a comment naming a file (``# export.py: ...``) is written to that file
  instead, for the shell block that runs it.
- ``bash``: run by ``bash -e -o pipefail`` in the working directory (``$M`` and ``$L`` name the onnx wheel's
  models, as the pages define them). A full-line comment after a command is that command's output: the output
  must hold a matching line.
- ``text`` right after a ``bash`` block (only blank lines between) is that block's output: each of its lines
  must match an output line, in order. Other text blocks (a synopsis, a picture of a terminal) are shown, not run.

Matching: ``...`` stands for anything; whole numbers must be equal (node counts, parameter counts); decimals
within 1% (losses and accuracies, reproducible to the shown digits on one machine but not across thread
counts); times and throughputs (``0:00:01``, ``38,983 samples/s``, ``in 1.8 s``) are not compared, and
progress-bar lines are left out (they are drawn on terminals only).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from sybil import Sybil
from sybil.evaluators.python import PythonEvaluator
from sybil.parsers.markdown import CodeBlockParser, SkipParser

NUMBER = re.compile(r"[-+]?(?:\d[\d,]*)?\.?\d+(?:e[-+]?\d+)?")
TIMING = [  # (pattern, replacement): what varies from run to run
    (re.compile(r"[\d,.]+ samples/s"), "<T> samples/s"),
    (re.compile(r"\b\d+:\d\d:\d\d\b"), "<T>"),
    (re.compile(r"\bin [\d.]+ s\b"), "in <T> s"),
    (re.compile(r'"samples_per_s": [\d.e+-]+'), '"samples_per_s": <T>'),
]
FILE_BLOCK = re.compile(r"#\s*([\w./-]+\.py):")


def _normal(line: str) -> str:
    line = " ".join(line.split())
    for pattern, repl in TIMING:
        line = pattern.sub(repl, line)
    return line


def _pattern(expected: str) -> tuple[re.Pattern, list[str]]:
    """A regex for an expected line (numbers captured, ``...`` as a wildcard) and the numbers it shows."""
    parts, numbers, pos = [], [], 0
    for m in NUMBER.finditer(expected):
        parts.append(re.escape(expected[pos:m.start()]))
        parts.append(r"([-+]?(?:\d[\d,]*)?\.?\d+(?:e[-+]?\d+)?)")
        numbers.append(m.group())
        pos = m.end()
    parts.append(re.escape(expected[pos:]))
    return re.compile("".join(parts).replace(re.escape("..."), ".*")), numbers


def _close(shown: str, got: str) -> bool:
    a, b = float(got.replace(",", "")), float(shown.replace(",", ""))
    if not any(c in shown for c in ".e"):
        return a == b
    mantissa = shown.split("e", maxsplit=1)[0]
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    return abs(a - b) <= max(1e-2 * abs(b), 10.0 ** -decimals if "e" not in shown else 0.0)


def matches(expected: str, actual: str) -> bool:
    """Does the output line ``actual`` say what the documented line ``expected`` says (module docstring)?"""
    pattern, numbers = _pattern(_normal(expected))
    m = pattern.fullmatch(_normal(actual))
    return bool(m) and all(_close(s, g) for s, g in zip(numbers, m.groups(), strict=True))


def _unmatched(expected: list[str], output: str) -> list[str]:
    """The expected lines that no output line matches (searched in order)."""
    lines = [ln for ln in output.splitlines() if "━" not in ln]
    missing, at = [], 0
    for want in expected:
        if not want.strip() or want.strip() == "..." or "━" in want:
            continue
        hit = next((k for k in range(at, len(lines)) if matches(want, lines[k])), None)
        if hit is None:
            missing.append(want)
        else:
            at = hit + 1
    return missing


def run_python(example) -> str | None:
    """A ``python`` block: written to the file its first line names, or executed in the page's namespace."""
    first = example.parsed.lstrip().split("\n", 1)[0]
    if m := FILE_BLOCK.match(first):
        Path(m.group(1)).write_text(example.parsed)
        return None
    return PythonEvaluator()(example)


def run_bash(example) -> str | None:
    """A ``bash`` block, run as a user runs it; its full-line output comments checked (module docstring)."""
    source = example.parsed
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", source], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900, check=False,
                          env={**os.environ, "COLUMNS": "250"})
    output = done.stdout
    example.namespace["_bash"] = (example.end, output)
    if done.returncode != 0:
        return f"exit {done.returncode} from:\n{source}\n--- output:\n{output[-4000:]}"
    expected, after_command = [], False
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("# ") and after_command:
            expected.append(stripped[2:])
        elif stripped and not stripped.startswith("#"):
            after_command = True
    missing = _unmatched(expected, output)
    return f"not in the output: {missing}\n--- output:\n{output[-4000:]}" if missing else None


def check_text(example) -> str | None:
    """A ``text`` block right after a ``bash`` block is its output (module docstring)."""
    end, output = example.namespace.get("_bash", (None, ""))
    if end is None or example.document.text[end:example.start].strip():
        return None  # shown, not an output
    missing = _unmatched(example.parsed.splitlines(), output)
    return f"not in the output: {missing}\n--- output:\n{output[-4000:]}" if missing else None


SYBIL = Sybil(parsers=[SkipParser(), CodeBlockParser("python", run_python), CodeBlockParser("bash", run_bash),
                       CodeBlockParser("text", check_text)], patterns=["*.md"])
