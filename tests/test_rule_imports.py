"""Rule families share helpers through ``autodiff/rules/_common.py`` (and the constant tables of ``tables.py``),
never by importing another family's private (underscore) names: one spelling of every shared helper."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import revgraph as rg

RULES_DIR = Path(rg.__file__).resolve().parent / "autodiff" / "rules"

#: every rule family (each module of autodiff/rules but the shared ones)
FAMILIES = sorted(p.stem for p in RULES_DIR.glob("*.py") if p.stem not in {"__init__", "_common", "tables"})
SHARED = {"_common", "tables"}


@pytest.mark.parametrize("family", FAMILIES)
def test_no_family_imports_another_familys_private_names(family):
    tree = ast.parse((RULES_DIR / f"{family}.py").read_text())
    private = [(node.module, a.name) for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module not in SHARED
               for a in node.names if a.name.startswith("_")]
    assert not private, f"{family}.py imports private names of other rule families: {private}"
