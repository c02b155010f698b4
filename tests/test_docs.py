"""Generated documentation stays in step with the code."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_op_coverage_is_up_to_date():
    spec = importlib.util.spec_from_file_location("gen_op_coverage", DOCS / "gen_op_coverage.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = gen.render()
    assert (DOCS / "op_coverage.md").read_text() == text, "run: python docs/gen_op_coverage.py"
    for op in ("Add", "MatMul", "Gather", "Loop", "If", "Scan"):
        assert f"| {op} | VJP rule |" in text
