"""Number and table formatting shared by the report modules (report, report_sections, report_hotspots), the
measures derived from the results that more than one section needs (the
revgraph / other ratio, contention of a multi-threaded step entry). It renders no section and imports none of the
section modules, so that each of them can import it without an import cycle.
"""

from __future__ import annotations

import re

MODEL_NAMES = {"mlp": "MLP", "cnn": "CNN", "transformer": "Transformer", "rnn": "RNN (Loop, T=100)"}


def s(x) -> str:
    if x is None:
        return "–"
    if x >= 100:
        return f"{x:,.0f} s"
    if x >= 1:
        return f"{x:.2f} s"
    if x >= 1e-3:
        return f"{1e3 * x:.1f} ms" if x >= 0.01 else f"{1e3 * x:.2f} ms"
    return f"{1e6 * x:.0f} µs"


def ms(x) -> str:
    if x is None:
        return "–"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}" if x >= 0.1 else f"{x:.3f}"


def ratio(x) -> str:
    return "–" if x is None else f"{x:.2f}x"


def table(header: list[str], rows: list[list], align: str | None = None) -> str:
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---:" if a == "r" else ":---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def top_ops(ops: dict, k: int = 6) -> str:
    return ", ".join(f"{o} {n}" for o, n in list(ops.items())[:k])


def contended(res: dict, e: dict) -> str:
    """Why a multi-threaded step entry is unreliable, or "": a framework that runs slower with more threads than
    with one on the same model and batch was competing for the cores with other processes (the machine is
    shared; OpenMP's and onnxruntime's spinning thread pools degrade badly when a core is taken)."""
    if e["threads"] == 1:
        return ""
    one = next((x for x in res["steps"]["grad"] if x["threads"] == 1 and x["model"] == e["model"]
                and x["batch"] == e["batch"]), None)
    if one is None:
        return ""
    slow = [fw for fw, t in e["ms"].items() if one["ms"].get(fw) and t > 1.1 * one["ms"][fw]]
    return (", ".join(slow) + f" slower with {e['threads']} threads than with 1") if slow else ""


def _r(a, b):
    return a / b if a and b else None


_PYTHON_LIB = re.compile(r"(?:/[^\s\"':()]+)*/lib/python3\.\d+/")


def portable(obj, roots: dict[str, str]):
    """``obj`` (results: dicts, lists, strings) with this machine's absolute paths replaced by placeholders, so
    that saved results name no directory of the machine that measured them: each ``roots`` prefix (the work
    directory, the repository) by its placeholder, and Python's library directories by ``<python>/``."""
    if isinstance(obj, dict):
        return {k: portable(v, roots) for k, v in obj.items()}
    if isinstance(obj, list):
        return [portable(v, roots) for v in obj]
    if isinstance(obj, str):
        for prefix, placeholder in sorted(roots.items(), key=lambda kv: -len(kv[0])):
            if prefix:
                obj = obj.replace(prefix, placeholder)
        return _PYTHON_LIB.sub("<python>/", obj)
    return obj
