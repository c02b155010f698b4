"""``bench/report.py`` re-renders docs/benchmarks.md without losing a line (issue 44, item 7): the sections other
benchmarks wrote after its document, marked (names with hyphens too) or not, are kept in order, and a second
render gives the same bytes as the first."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "bench" / "results" / "full.json"
BEGIN = re.compile(r"^<!-- ([\w-]+):begin -->$", re.MULTILINE)


@pytest.fixture
def report(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # (bench's modules import one another by bare name)
    monkeypatch.chdir(ROOT)
    import report as module

    return module


def _marked(text: str) -> dict[str, str]:
    """name -> the section between ``<!-- name:begin -->`` and ``<!-- name:end -->``, markers included."""
    return {n: re.search(rf"<!-- {re.escape(n)}:begin -->.*?<!-- {re.escape(n)}:end -->", text, re.DOTALL).group(0)
            for n in BEGIN.findall(text)}


def _after_reproduce(text: str) -> str:
    """The text after the generated document's last section (*Reproduce*): what other benchmarks wrote."""
    start = text.index("\n## Reproduce")
    return text[re.compile(r"^(## |<!-- )", re.MULTILINE).search(text, start + 2).start():]


def test_a_render_from_the_committed_results_keeps_every_line_and_is_stable(report, tmp_path):
    doc = tmp_path / "benchmarks.md"
    shutil.copy(DOC, doc)
    before = doc.read_text()
    sections = _marked(before)
    # the sections the issue found lost: two with hyphens, and those that had no markers
    assert {"ddp", "ddp-overlap", "ddp-memory", "chunked-loss", "guards-27", "guards-39", "optimized-files"} <= \
        set(sections)
    argv = [str(RESULTS.relative_to(ROOT)), "-o", str(doc)]
    assert report.main(argv) == 0
    first = doc.read_text()
    assert report.main(argv) == 0
    assert doc.read_text() == first  # the second render gives the same bytes
    for name, text in sections.items():
        assert first.count(text) == 1, name
    # every line after the generated document, marked or not, is kept, in order
    assert _after_reproduce(first) == _after_reproduce(before)
    assert len(first.splitlines()) >= len(before.splitlines()) - 5  # (the generated part itself may differ a little)


def test_hyphenated_unmarked_and_inner_sections_are_kept(report, tmp_path):
    doc = tmp_path / "b.md"
    doc.write_text("# Benchmarks\n\nold numbers\n\n<!-- early:begin -->\n## Early\ne\n<!-- early:end -->\n\n"
                   "## Reproduce\n\n```bash\npython bench/run.py\n```\n\n"
                   "<!-- ddp-overlap:begin -->\n## Overlap\no\n<!-- ddp-overlap:end -->\n\n"
                   "## Written by hand\n\nh\n\n<!-- chunked-loss:begin -->\n## Chunks\nc\n<!-- chunked-loss:end -->\n")
    new = "# Benchmarks\n\nnew numbers\n\n## Reproduce\n\n```bash\npython bench/run.py\n```\n"
    report.write(doc, new)
    assert doc.read_text() == (
        new + "\n<!-- early:begin -->\n## Early\ne\n<!-- early:end -->\n\n"
        "<!-- ddp-overlap:begin -->\n## Overlap\no\n<!-- ddp-overlap:end -->\n\n"
        "## Written by hand\n\nh\n\n<!-- chunked-loss:begin -->\n## Chunks\nc\n<!-- chunked-loss:end -->\n")
    once = doc.read_text()
    report.write(doc, new)
    assert doc.read_text() == once


def test_a_new_file_is_the_document_alone(report, tmp_path):
    report.write(tmp_path / "new.md", "# Benchmarks\n\n## Reproduce\n\nx\n")
    assert (tmp_path / "new.md").read_text() == "# Benchmarks\n\n## Reproduce\n\nx\n"


@pytest.mark.parametrize("markers", ["<!-- ddp-x:begin -->\nt\n", "t\n<!-- ddp-x:end -->\n",
                                     "<!-- a:begin -->\n<!-- a:end -->\n<!-- a:begin -->\n<!-- a:end -->\n"])
def test_unpaired_markers_are_refused_in_one_line_and_the_file_is_left_alone(report, tmp_path, capsys, markers):
    doc = tmp_path / "b.md"
    old = "# Benchmarks\n\n## Reproduce\n\nx\n\n" + markers
    doc.write_text(old)
    with pytest.raises(SystemExit) as exc:
        report.main([str(RESULTS), "-o", str(doc)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "unpaired or repeated" in err and str(doc) in err and "pair them" in err, err
    assert doc.read_text() == old
