"""One way for revgraph to warn: :func:`warn`, attributed to the user's line that called into revgraph.

A warning raised deep inside revgraph (a rule, the memory planner) and reached through a public function
decorated with :func:`revgraph.validate.arguments` would otherwise name revgraph's own frames (``validate.py``'s
wrapper with a fixed ``stacklevel``), so that ``warnings.filterwarnings(module=...)`` and the printed location
point at revgraph rather than at the caller. Python 3.12's ``skip_file_prefixes`` does this; on 3.11 the
``stacklevel`` is computed the same way: the first frame outside this package.
"""

from __future__ import annotations

import os
import sys
import warnings

#: Frames in files under this directory are revgraph's own, skipped when a warning is attributed.
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _internal(filename: str) -> bool:
    # (frames that Python's warnings module itself skips when it counts stacklevel)
    return "importlib" in filename and "_bootstrap" in filename


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first caller outside revgraph (its file and line),
    whichever public function or command the warning came through. ``message``: one line."""
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, skip_file_prefixes=(PACKAGE_DIR,))
        return
    level, frame = 2, sys._getframe(1)  # stacklevel 2: warn's caller
    while frame is not None:
        name = frame.f_code.co_filename
        if not _internal(name):
            if not os.path.abspath(name).startswith(PACKAGE_DIR):
                break
            level += 1
        frame = frame.f_back
    warnings.warn(message, category, stacklevel=level if frame is not None else 1)
