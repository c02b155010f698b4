"""The length distribution of revgraph's VJP rules (issue 14 asked for it before and after the rule-boundary
change): lines of each function registered with ``@vjp`` or ``@unary``, docstring, blank and comment lines left out.

    python docs/rule_lengths.py [DIR]     # default: src/revgraph/autodiff
"""

from __future__ import annotations

import ast
import statistics
import sys
from pathlib import Path

DECORATORS = ("vjp", "unary", "_unary", "slope")


def rule_lengths(root: Path) -> dict[str, int]:
    """``{"<file>:<function>": lines}`` for every rule function under ``root``."""
    lengths = {}
    for path in sorted(root.rglob("*.py")):
        src = path.read_text().splitlines()
        for fn in ast.walk(ast.parse("\n".join(src))):
            if not isinstance(fn, ast.FunctionDef) or not any(
                    isinstance(d, ast.Call) and getattr(d.func, "id", getattr(d.func, "attr", "")) in DECORATORS
                    for d in fn.decorator_list):
                continue
            documented = isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant)
            body = fn.body[1:] if documented else fn.body
            if body:
                lines = [s for s in src[body[0].lineno - 1: fn.end_lineno]
                         if s.strip() and not s.strip().startswith("#")]
                lengths[f"{path.relative_to(root)}:{fn.name}"] = len(lines)
    return lengths


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent.parent / "src/revgraph/autodiff")
    lengths = rule_lengths(root)
    v = sorted(lengths.values())
    print(f"{len(v)} rules: {sum(x <= 5 for x in v)} of 1-5 lines, {sum(6 <= x <= 20 for x in v)} of 6-20, "
          f"{sum(x > 20 for x in v)} over 20; median {statistics.median(v)}, longest {max(v)}")
    for name, n in sorted(lengths.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {n:4d}  {name}")
