"""The documentation site (issue 44, item 2): ``mkdocs build --strict`` of mkdocs.yml, as CI builds it.

Strict mode turns MkDocs' warnings into a failed build: a link to a page or anchor that does not exist, a page
missing from the navigation, a mkdocstrings reference that does not resolve. The generated reference pages are
compared with what they are generated from (the argparse parsers, ``revgraph.__all__``), and a page with a
broken link is shown to fail the build. The slow test looks at the built front page in headless Chromium.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mkdocs  # noqa: F401  # (in the test extra: missing, it fails instead of skipping)
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of ``config`` into ``site``, from the repository root."""
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config),
                           "-d", str(site)], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = _build(ROOT / "mkdocs.yml", out)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def _text(page: Path) -> str:
    """The visible text of an HTML page (tags dropped, entities decoded)."""
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


def test_every_page_of_the_navigation_is_built(site):
    pages = [p.relative_to(ROOT / "docs").with_suffix("") for p in (ROOT / "docs").rglob("*.md")]
    assert len(pages) >= 15
    for page in pages:
        built = site / ("index.html" if page.name == "index" else f"{page.as_posix()}/index.html")
        assert built.is_file(), page
    for generated in ("cli", "api"):
        assert (site / "reference" / generated / "index.html").is_file()
    assert "Who it is for" in _text(site / "index.html")


def test_cli_reference_is_the_parsers_help(site):
    """Every subcommand and every option it shows in ``--help``, as argparse knows them, is on the generated page."""
    import argparse

    from revgraph import cli

    page = _text(site / "reference" / "cli" / "index.html")
    parser = (getattr(cli, "build_parser", None) or cli._parser)()  # (as docs/hooks/cli_reference.py)
    todo = [("revgraph", parser)]
    seen = 0
    while todo:
        title, p = todo.pop()
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += [(f"{title} {name}", sub) for name, sub in action.choices.items()]
            for option in action.option_strings if action.help != argparse.SUPPRESS else ():  # (hidden aliases)
                assert option in page, (title, option)
                seen += 1
        if title != "revgraph":
            assert title in page, title
    assert seen > 150  # (every option of every subcommand: train alone has more than 60)


def test_api_reference_documents_every_public_name(site):
    """Each name of ``revgraph.__all__`` has a section holding (the start of) its own docstring."""
    import inspect

    import revgraph

    page = _text(site / "reference" / "api" / "index.html")
    for name in revgraph.__all__:
        assert f"rg.{name}" in page, name
        doc = inspect.getdoc(getattr(revgraph, name))
        if doc and not isinstance(getattr(revgraph, name), int):
            words = " ".join(re.sub(r"`+|\*+", "", doc.split("\n\n")[0]).split()[:6])
            assert " ".join(words.split()) in " ".join(page.split()), (name, words)


def test_a_broken_link_fails_the_strict_build(tmp_path):
    """The same configuration over a copy of docs/ with one link to a missing page: the build fails naming it."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "docs" / "why.md").write_text((ROOT / "docs" / "why.md").read_text() + "\n[gone](guides/gone.md)\n")
    config = (ROOT / "mkdocs.yml").read_text().replace("paths: [src]", f"paths: [{ROOT / 'src'}]")
    config = config.replace("docs/hooks/cli_reference.py", str(tmp_path / "docs" / "hooks" / "cli_reference.py"))
    (tmp_path / "mkdocs.yml").write_text(config.replace("docs_dir: docs", f"docs_dir: {tmp_path / 'docs'}"))
    done = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0 and "guides/gone.md" in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_front_page_screenshot_in_headless_chromium(site, tmp_path):
    """Headless Chromium renders the built front page: a PNG of the window's size, not one flat colour."""
    browser = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)),
                   None)
    if browser is None:
        pytest.skip("no chromium binary (apt-get install chromium)")
    png = tmp_path / "front.png"
    done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                           "--hide-scrollbars", "--window-size=1280,900", f"--screenshot={png}",
                           (site / "index.html").as_uri()], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and png.is_file(), done.stderr[-2000:]
    from PIL import Image

    image = Image.open(png).convert("RGB")
    assert image.size == (1280, 900)
    colours = image.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50  # text, the header bar, the table: many colours
    dark = sum(n for n, (r, g, b) in colours if r + g + b < 300)
    assert dark > 2000, dark  # the page's text is drawn (not a blank page)
    header = image.crop((0, 0, 1280, 40)).getcolors(maxcolors=1 << 20)
    assert max(header)[1] != (255, 255, 255)  # Material's coloured header bar: the stylesheet was applied
