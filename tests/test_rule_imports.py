"""Rule families share helpers through ``autodiff/rules/_common.py`` (and the constant tables of ``tables.py``),
never by importing another family's private (underscore) names: one spelling of every shared helper."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import revgraph as rg

RULES_DIR = Path(rg.__file__).resolve().parent / "autodiff" / "rules"

#: the families ported to the rule algebra with their helpers in _common (the geometry and grids port); the
#: other families join this list as their helpers move
FAMILIES = ["conv", "deform", "pool", "sampling", "resize", "roi", "sequence", "spectral"]
SHARED = {"_common", "tables"}


@pytest.mark.parametrize("family", FAMILIES)
def test_no_family_imports_another_familys_private_names(family):
    tree = ast.parse((RULES_DIR / f"{family}.py").read_text())
    private = [(node.module, a.name) for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module not in SHARED
               for a in node.names if a.name.startswith("_")]
    assert not private, f"{family}.py imports private names of other rule families: {private}"
