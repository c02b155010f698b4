"""A long-lived benchmark worker: reads one JSON request per line on stdin, answers one JSON line.

A request is ``{"call": "module:function", "args": {...}}``; the module is imported from this directory.
The answer is ``{"ok": true, "result": ...}`` or ``{"ok": false, "error": "<one line>", "traceback": "..."}``.
bench/run.py starts one worker per framework (and per virtual environment) and sends them work in turns,
so that what it compares runs side by side, alternately, on the same machine in the same minutes.

The protocol uses a private copy of the original stdout; file descriptor 1 is pointed at stderr, so that
whatever a library prints (from Python or from C++) cannot corrupt an answer.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback


def main() -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        module, _, function = request["call"].partition(":")
        try:
            result = getattr(importlib.import_module(module), function)(**request.get("args", {}))
            answer = {"ok": True, "result": result}
        except BaseException as exc:  # noqa: BLE001 - every failure is reported to the orchestrator
            message = str(exc).strip().splitlines()
            answer = {"ok": False, "error": f"{type(exc).__name__}: {message[0] if message else ''}"[:2000],
                      "traceback": traceback.format_exc()[-4000:]}
        proto.write(json.dumps(answer, default=_jsonable) + "\n")
        proto.flush()
    return 0


def _jsonable(x):
    try:
        import numpy as np

        if isinstance(x, np.generic):
            return x.item()
        if isinstance(x, np.ndarray):
            return x.tolist()
    except ImportError:
        pass
    return str(x)


if __name__ == "__main__":
    sys.exit(main())
