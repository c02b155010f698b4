"""The project's lint: ``ruff check .`` at the rule set of pyproject.toml's ``[tool.ruff.lint]`` is clean.

CI runs the README's test command, so this test is what runs the lint there. ruff is pinned in the test extra
(``ruff==X.Y.Z``): its rules and default settings change between versions, so the version is checked first.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pinned_ruff() -> str:
    """The version pyproject.toml pins (``"ruff==0.17.6"`` in the test extra; read as text: tomllib is 3.11+)."""
    pins = re.findall(r'^\s*"ruff==([\w.]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert len(pins) == 1, f"pyproject.toml pins ruff exactly once (\"ruff==X.Y.Z\" in the test extra), not {pins}"
    return pins[0]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)


def test_ruff_is_the_pinned_version():
    got = _ruff("--version")
    assert got.returncode == 0, f"ruff is not installed: pip install -e '.[test]'\n{got.stderr}"
    assert got.stdout.split() == ["ruff", _pinned_ruff()], got.stdout


def test_ruff_check_is_clean():
    got = _ruff("check", ".", "--output-format", "concise", "--no-cache")
    assert got.returncode == 0, f"ruff check . found (fix them, or `ruff check --fix .`):\n{got.stdout}{got.stderr}"
