"""docs/benchmarks.md from the results of bench/run.py (``render``), or from a saved JSON file:

    python bench/report.py bench/results/full.json -o docs/benchmarks.md

Sections 1 to 4 are rendered by report_sections, section 5 by report_hotspots, and the formatting they share lives
in report_format; this module writes the header, the goals and the reproduce section and puts them together.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

import report_goals
from report_format import table
from report_hotspots import hotspots_section
from report_sections import build_section, memory_section, size_section, steps_section


def header(res: dict, json_path) -> str:
    m = res["machine"]
    v = res.get("versions", {})
    rgv = v.get("revgraph worker", {})
    ortv = v.get("onnxruntime-training worker", {})
    jv = v.get("jax worker", {})
    lines = [
        "# Benchmarks",
        "",
        (f"Written by `{res['command']}` ({res['mode']} run) on {res['started'][:10]}, in "
         f"{res.get('seconds', 0) / 60:.1f} minutes. Raw numbers: `{_rel(json_path)}`. Every comparison below was "
         "measured in the same run, on the same machine, with the frameworks taking turns (round-robin between "
         "worker processes); times are medians over the rounds, ratios are ratios of those medians."),
        "",
        table(["", ""], [
            ["machine", f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, {m['os']}"],
            ["load average (1, 5, 15 min)", (f"{res.get('load_start')} at the start, {res.get('load_end')} at the end "
             "(the machine is shared: other processes ran during the benchmark)")],
            ["revgraph", f"commit {m['commit']}" + (" with local changes under src/" if m.get("src_modified") else "")
             + f", Python {m['python']}"],
            ["revgraph's runtime", (f"onnxruntime {rgv.get('onnxruntime')}, onnx {rgv.get('onnx')}, "
             f"numpy {rgv.get('numpy')}")],
            ["PyTorch", f"{v.get('pytorch worker', {}).get('torch')} (eager, CPU)"],
            ["JAX", f"jax {jv.get('jax')}, jaxlib {jv.get('jaxlib')}, numpy {jv.get('numpy')} (own venv)" if jv
             else "not available"],
            ["onnxruntime-training", f"{ortv.get('onnxruntime-training')} with onnx {ortv.get('onnx')}, numpy "
             f"{ortv.get('numpy')}, torch {ortv.get('torch')} (own venv)" if ortv else "not available"],
        ], "ll"),
    ]
    if res.get("errors"):
        lines += ["", "Errors during the run: " + "; ".join(res["errors"])]
    return "\n".join(lines)


BASELINE = Path(__file__).resolve().parent / "results" / "before-round2.json"


def load_baseline(path) -> dict | None:
    """The saved results at ``path``, or ``None`` when there is no such file (or ``path`` is empty)."""
    return json.loads(Path(path).read_text()) if path and Path(path).is_file() else None


def _rel(p) -> str:
    try:
        return str(Path(p).resolve().relative_to(Path(__file__).resolve().parents[1]))
    except ValueError:
        return str(p)


def goals(res: dict, baseline: dict | None = None) -> str:
    """The goals table (report_goals), with the same goals measured on ``baseline`` as *before*."""
    rows = report_goals.goals(res)
    if not rows:
        return ""
    text = ["## Goals", "", ("Ratio = revgraph's time / the other's time (below 1: revgraph is faster); the update "
            "rows compare the cost of the optimizer update itself (section 2, *Whole Adam step*).")]
    if baseline is None:
        return "\n".join([*text, "", table(["goal", "now", "met?"], [[g.name, g.show(), g.verdict()] for g in rows],
                                           "lrl")])
    before = {g.name: g for g in report_goals.goals(baseline)}
    commit = baseline.get("machine", {}).get("commit", "?")
    text.append(f"*Before* is the same benchmark on commit {commit} (`{_rel(BASELINE)}`, a full run on "
                f"{baseline.get('started', '?')[:10]}), before the changes of this round (section 5).")
    return "\n".join([*text, "", table(["goal", "before", "now", "met?"],
                                       [[g.name, before[g.name].show() if g.name in before else "–", g.show(),
                                         g.verdict()] for g in rows], "lrrl")])


def reproduce(res: dict) -> str:
    return "\n".join([  # noqa: FLY002 (one line per command reads as the shell block it renders)
        "## Reproduce", "",
        "```bash",
        ("python bench/run.py            # everything above (full run), writes docs/benchmarks.md and "
         "bench/results/full.json"),
        "python bench/run.py --quick    # the same at smaller sizes and fewer rounds, under 10 minutes",
        "python bench/run.py --sections build,memory     # a subset (build, step, memory, profile)",
        "python bench/envs.py           # create the onnxruntime-training and JAX environments only",
        "python bench/loop_memory.py    # the loop-memory table alone",
        "python bench/build_time.py     # revgraph's build time alone",
        "python bench/report.py bench/results/full.json -o docs/benchmarks.md   # re-render from saved numbers",
        "```", "",
        ("The first run creates `venv-ort-training` (numpy<2, torch==2.13.0, onnxruntime-training==1.19.2, "
         "onnx==1.17.0) and `venv-jax` (jax==0.10.2) next to the project directory (`--venv-dir` elsewhere). "
         "On a shared machine the absolute times move with the load; the ratios, measured in alternation, move "
         "less."), ""])


def render(res: dict, json_path=None, baseline: dict | None = None) -> str:
    """The whole document; ``baseline`` (results of an earlier run) adds a *before* column to the goals."""
    parts = [header(res, json_path or ""), goals(res, baseline), build_section(res), steps_section(res),
             memory_section(res), size_section(res), hotspots_section(res), reproduce(res)]
    return "\n\n".join(p.strip() for p in parts if p) + "\n"


#: a section another benchmark wrote (``ddp``, ``ddp-overlap``, ``chunked-loss``, ...: names may have hyphens)
_SECTION = re.compile(r"<!-- ([\w-]+):begin -->.*?<!-- \1:end -->\n?", re.DOTALL)
_MARKER = re.compile(r"^<!-- ([\w-]+):(begin|end) -->$", re.MULTILINE)
#: where this module's document ends in an old file: after its last section, the first heading or begin marker
_TAIL = re.compile(r"^(## |<!-- [\w-]+:begin -->)", re.MULTILINE)
_LAST_HEADING = "## Reproduce"


def kept_sections(old: str) -> str:
    """What :func:`write` keeps of the old file ``old``: everything after this module's document (its last
    section is *Reproduce*), marked sections and unmarked text alike, and any marked section found inside the
    document's part. Raises ``ValueError`` for a begin marker without its end marker (or the reverse), which
    would otherwise lose the text between them."""
    markers = Counter((m.group(1), m.group(2)) for m in _MARKER.finditer(old))
    unpaired = sorted({n for n, _ in markers if markers[n, "begin"] != 1 or markers[n, "end"] != 1})
    if unpaired:
        raise ValueError(f"unpaired or repeated <!-- NAME:begin/end --> markers in the old document: {unpaired}")
    last = old.find("\n" + _LAST_HEADING)
    found = _TAIL.search(old, last + 1 + len(_LAST_HEADING)) if last >= 0 else _SECTION.search(old)
    start = found.start() if found else len(old)
    inside = [m.group(0).rstrip("\n") for m in _SECTION.finditer(old, 0, start)]
    return "\n\n".join([*inside, old[start:].strip("\n")]).strip("\n")


def write(path: str | Path, text: str) -> None:
    """Write ``text`` (this module's document) to ``path``, keeping what other benchmarks wrote into the old file
    after it (:func:`kept_sections`: the sections between ``<!-- name:begin -->`` and ``<!-- name:end -->``
    markers, and any text after the document's last section), in order: a re-render loses no line."""
    path = Path(path)
    kept = kept_sections(path.read_text()) if path.exists() else ""
    path.write_text(text if not kept else text.rstrip("\n") + "\n\n" + kept + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="render docs/benchmarks.md from bench/run.py's JSON")
    parser.add_argument("json")
    parser.add_argument("-o", "--output", default=str(Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"))
    parser.add_argument("--baseline", default=str(BASELINE),
                        help="results of an earlier run to compare the goals with ('' for none)")
    args = parser.parse_args(argv)
    res = json.loads(Path(args.json).read_text())
    try:
        write(args.output, render(res, json_path=args.json, baseline=load_baseline(args.baseline)))
    except ValueError as exc:  # markers that would lose text: one line, exit 2, the file left as it was
        parser.error(f"{args.output}: {exc}; pair them, then run again")
    return 0


if __name__ == "__main__":
    sys.exit(main())
