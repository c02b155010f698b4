"""A torchrun entry point for tests/test_distributed_launch.py: runs ``revgraph ARGS`` like ``-m revgraph``, with
extra arguments on one rank, as a user would give the ranks different commands by mistake. Usage:
``launch_worker.py [--on-rank R N ARG1 .. ARGN]... -- train MODEL ...`` (the N arguments are appended on rank R)."""

from __future__ import annotations

import os
import sys

from revgraph.cli import main

if __name__ == "__main__":
    argv, extra = sys.argv[1:], {}
    while argv and argv[0] == "--on-rank":
        rank, n = argv[1], int(argv[2])
        extra.setdefault(rank, []).extend(argv[3:3 + n])
        argv = argv[3 + n:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    sys.exit(main(argv + extra.get(os.environ.get("RANK", ""), [])))
