"""Terminal-safe text: names from a model are shown literally.

A model is untrusted input, and its value, node and operator names reach the terminal in tables, notes and
error lines. Printed raw, an ESC or OSC sequence in a name could clear the screen, set the window title or
hide text; a carriage return or newline could overwrite or fake a line; a right-to-left override could show
text in another order; and Rich would read ``[bold red]x[/]`` or ``[link=...]`` in a name as markup (and
``x[/oops]`` as an error). :func:`literal` escapes every character that a terminal acts on instead of
showing (Python's ``str.isprintable``: C0/C1 controls, DEL, line and paragraph separators, format characters
such as bidirectional overrides, lone surrogates) the way ``repr`` does, so one line stays one line;
:func:`cell` wraps the result in a Rich ``Text``, which Rich never reads as markup. The command line prints
through a :class:`LiteralConsole`, which applies :func:`literal` to every string it renders (lines, table
cells, titles) and reads no markup or emoji codes in them, so a new print cannot forget it; styled text is
built as ``Text`` with :func:`cell`.
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def _escape(ch: str) -> str:
    code = ord(ch)
    if ch in _NAMED:
        return _NAMED[ch]
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def literal(text: object) -> str:
    """``str(text)`` with every non-printable character escaped as ``repr`` would (``\\x1b``, ``\\n``,
    ``\\u202e``; printable non-ASCII text such as ``é`` stays as it is). A backslash is doubled, as ``repr``
    doubles it, so that the name ``a\\nb`` (written with a backslash) shows as ``a\\\\nb`` and the name with a
    newline as ``a\\nb``: the escaping can be read back. The result is one line and holds no character a
    terminal would interpret."""
    text = str(text)
    if text.isprintable() and "\\" not in text:  # the common case: nothing to escape
        return text
    return "".join(ch if ch.isprintable() and ch != "\\" else _escape(ch) for ch in text)


def cell(text: object, style: str = "") -> Text:
    """:func:`literal` as a Rich ``Text`` (for table cells and titles): shown as written, never as markup."""
    return Text(literal(text), style=style)


class LiteralConsole(Console):
    """A Rich console that shows every string literally: :func:`literal` is applied to each string it renders
    (printed lines, table cells and titles, progress descriptions), and markup (``[red]``) and emoji codes
    (``:smile:``) in it are shown as written. ``Text`` objects (styled with :func:`cell`) pass unchanged."""

    def on_broken_pipe(self) -> None:
        """The reader of the output went away: stop writing, and let :func:`revgraph.cli.main` end the command
        quietly with 128 + SIGPIPE (Rich's default exits 1, which reads as "a check found a disagreement")."""
        self.quiet = True
        raise BrokenPipeError

    def render_str(self, text: str, **kwargs) -> Text:  # type: ignore[override]
        kwargs.update(markup=False, emoji=False)
        return super().render_str(literal(text), **kwargs)
