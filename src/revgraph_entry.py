"""The ``revgraph`` console script's entry point, outside the package on purpose: importing ``revgraph.cli`` loads
numpy, onnx and onnxruntime first (seconds), and a Ctrl-C in that time printed a traceback, as no handler of
revgraph's was installed yet (issue 40). This module imports nothing heavy; it catches the interrupt around the
import and ends as the command does when interrupted later (one line, exit 130)."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from revgraph.cli import main as run
        from revgraph.train.distributed.launch import leave_worker
    except KeyboardInterrupt:
        sys.stderr.write("revgraph: interrupted\n")
        return 130
    code = run()
    leave_worker(code)  # (a worker's refusal ends without finalization, as under python -m revgraph: issue 43)
    return code
