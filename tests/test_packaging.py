"""The package follows Python's conventions (issue 44, item 4): a LICENSE, ``py.typed``, a complete ``__all__``, a
changelog, the version in one place with ``revgraph --version``, no broken links in the repository; and (slow) a
wheel from ``python -m build`` that installs into a fresh virtual environment and runs the demo."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

import revgraph as rg
from revgraph.cli import main
from revgraph.version import __version__

ROOT = Path(__file__).resolve().parents[1]
INIT = ROOT / "src" / "revgraph" / "__init__.py"


def _public_imports() -> set[str]:
    """The public names ``revgraph/__init__.py`` binds with ``from ... import`` (read from its source, so that a
    name imported there and left out of ``__all__`` is caught), and those its module ``__getattr__`` serves
    besides the moved modules."""
    tree = ast.parse(INIT.read_text())
    names = {a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom) for a in node.names}
    getattr_fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "__getattr__")
    served = {c.comparators[0].value for c in ast.walk(getattr_fn) if isinstance(c, ast.Compare)
              and isinstance(c.ops[0], ast.Eq) and isinstance(c.comparators[0], ast.Constant)}
    return {n for n in names | served if not n.startswith("_")}


def test_all_lists_every_public_name_imported_in_the_package():
    public = _public_imports()
    assert {"Trainer", "lora", "gradient", "Graph", "export_torch"} <= public  # (the reader above sees them)
    assert sorted(public - set(rg.__all__)) == []
    assert len(rg.__all__) == len(set(rg.__all__))
    for name in rg.__all__:  # every listed name resolves (export_torch through the module __getattr__)
        assert getattr(rg, name) is not None, name


def test_star_import_gives_every_listed_name():
    scope: dict = {}
    exec("from revgraph import *", scope)  # noqa: S102
    assert {"Trainer", "lora", "gradient", "Session"} <= set(scope)
    assert scope["Trainer"] is rg.Trainer and scope["lora"] is rg.lora


def test_version_is_in_one_place_and_printed_by_the_cli(capsys):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "revgraph.version.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__) and rg.__version__ == __version__
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"revgraph {__version__}\n"


def test_license_is_the_apache_license_pyproject_declares():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "9. Accepting Warranty or Additional Liability." in text


def test_py_typed_is_package_data():
    assert (ROOT / "src" / "revgraph" / "py.typed").is_file()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["revgraph"]


def test_changelog_has_an_unreleased_section_and_this_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## \[([^\]]+)\]", text, re.MULTILINE)
    assert headings[0] == "Unreleased" and __version__ in headings
    assert re.search(rf"^## \[{re.escape(__version__)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", text, re.MULTILINE)
    assert "keepachangelog.com" in text


def test_no_broken_symbolic_links_are_tracked():
    tracked = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    links = [line.split("\t", 1)[1] for line in tracked.splitlines() if line.startswith("120000 ")]
    assert [p for p in links if not (ROOT / p).exists()] == []


def _venv(path: Path) -> Path:
    """A virtual environment that sees the system's site-packages (torch, onnxruntime, ... need no download)
    and has no pip or setuptools of its own (the ones venv bundles would shadow the system's newer
    setuptools): ``python -m pip`` is the system's pip, installing into this environment."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(path)], check=True)
    return path / "bin" / "python"


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_runs_the_demo(tmp_path):
    # A clean copy of the sources: the working tree's build/ may hold modules that have since moved
    src = tmp_path / "src-copy"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))

    builder = _venv(tmp_path / "build-env")
    # the build frontend, into the build environment only (already satisfied where the system python has it)
    subprocess.run([str(builder), "-m", "pip", "install", "-q", "build"], check=True)
    # --no-isolation: the build backend is the installed setuptools (pyproject asks >=77), not a download
    proc = subprocess.run([str(builder), "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "dist"),
                           str(src)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("revgraph-*.whl")
    assert wheel.name.startswith(f"revgraph-{__version__}-")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert {"revgraph/py.typed", "revgraph/__init__.py", "revgraph_entry.py"} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)

    env_dir = tmp_path / "run-env"
    python = _venv(env_dir)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True)
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = subprocess.run([str(python), "-c", "import revgraph; print(revgraph.__file__)"], cwd=tmp_path, env=clean,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(env_dir), where  # the wheel's copy, not the editable checkout
    script = env_dir / "bin" / "revgraph"
    version = subprocess.run([str(script), "--version"], capture_output=True, text=True, env=clean, check=True)
    assert version.stdout == f"revgraph {__version__}\n"
    demo = subprocess.run([str(script), "demo", "--quick", "-o", str(tmp_path / "demo")], cwd=tmp_path, env=clean,
                          capture_output=True, text=True, timeout=600, check=False)
    assert demo.returncode == 0, demo.stderr[-3000:]
    accuracies = [float(a) for a in re.findall(r"test accuracy ([\d.]+)%", demo.stdout)]
    assert len(accuracies) == 2 and min(accuracies) > 50, demo.stdout  # 10 classes: chance is 10%
    for name in ("rnn.onnx", "rnn.train.onnx", "mlp.onnx", "mlp.train.onnx", "loss.svg"):
        assert (tmp_path / "demo" / name).stat().st_size > 0, name
