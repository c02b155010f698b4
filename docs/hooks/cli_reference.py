"""MkDocs hook: the two reference pages, generated at build time so that they cannot go stale.

- ``reference/cli.md`` from revgraph's argparse parsers (``revgraph.cli``): what ``revgraph COMMAND --help``
  says. Each subcommand (and each subcommand of a subcommand, ``lora extract``) gets a section holding its
  ``format_help()`` text, formatted at a fixed width of 100 columns so that the page does not depend on the
  terminal that builds it.
- ``reference/api.md`` from ``revgraph.__all__``: one mkdocstrings section (``::: path``) per public name,
  at the path where the object is defined (mkdocstrings then renders its docstring and signature).
"""

from __future__ import annotations

import argparse
import os
from contextlib import contextmanager

PAGE = "reference/cli.md"
API_PAGE = "reference/api.md"
WIDTH = "100"


@contextmanager
def _columns(width: str):
    """argparse sizes its help from ``COLUMNS`` (``shutil.get_terminal_size``): fix it while formatting."""
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = width
    try:
        yield
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    """``(name, parser)`` of each subcommand, in the order they were added, aliases once."""
    found, seen = [], set()
    for action in parser._actions:  # (argparse keeps its subparsers only here)
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    found.append((name, sub))
    return found


def render() -> str:
    """The page's markdown: the top-level help, then each subcommand's, nested ones after their parent."""
    from revgraph import cli

    build = getattr(cli, "build_parser", None) or cli._parser
    root = build()
    parts = ["# Command line\n",
             ("Generated from the argparse parsers of `revgraph.cli` when the site is built: each section is what "
             "`revgraph COMMAND --help` prints. Exit codes: 0 success, 1 `check` found gradients that disagree, "
             "2 bad input (one line naming the file, value or option), 3 an internal error.\n")]
    with _columns(WIDTH):
        parts.append(f"```text\n{root.format_help().rstrip()}\n```\n")
        todo = [("revgraph " + name, sub) for name, sub in _subcommands(root)]
        while todo:  # (iterative: nested subcommands follow their parent)
            title, sub = todo.pop(0)
            parts.append(f"## `{title}`\n\n```text\n{sub.format_help().rstrip()}\n```\n")
            todo[:0] = [(f"{title} {name}", nested) for name, nested in _subcommands(sub)]
    return "\n".join(parts)


def _defined_at(name: str) -> str:
    """The dotted path where ``revgraph.<name>`` is defined (a function, class or module), else ``revgraph.<name>``."""
    import inspect

    import revgraph

    obj = getattr(revgraph, name)
    if inspect.ismodule(obj):
        return obj.__name__
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if module and qualname and (inspect.isclass(obj) or inspect.isfunction(obj)):
        return f"{module}.{qualname}"
    return f"revgraph.{name}"


def render_api() -> str:
    """The API page's markdown: every name of ``revgraph.__all__``, in its order."""
    import revgraph

    parts = ["# Python API\n",
             ("The public names of `revgraph` (its `__all__`), generated from their docstrings when the site is "
             "built. `import revgraph as rg`; wherever a model is expected, an `rg.Graph`, an `onnx.ModelProto` (or "
             "its bytes) or the path of an `.onnx` file is taken.\n")]
    for name in revgraph.__all__:
        parts.append(f"## `rg.{name}`\n\n::: {_defined_at(name)}\n    options:\n      show_root_heading: false\n"
                     f"      show_root_toc_entry: false\n")
    return "\n".join(parts)


def on_files(files, config):
    """Add the generated pages to the site's files (MkDocs calls this after collecting docs_dir)."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    files.append(File.generated(config, API_PAGE, content=render_api()))
    return files
