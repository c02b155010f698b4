"""Worker of tests/test_build_bounds.py: builds gradients (``revgraph grad``) and JVPs (``revgraph jvp``) of
models that declare huge shapes or attributes, under an address-space limit, and prints one JSON line per
build: the command's exit code, its stderr, the peak of Python-traced memory during the build (numpy's arrays
are traced) and the written graph's size.

Usage: ``python build_bounds_worker.py LIMIT_BYTES OUT_DIR MODEL.onnx [MODEL.onnx ...]``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import sys
import time
import tracemalloc


def main(argv: list[str]) -> int:
    limit, out_dir, models = int(argv[0]), argv[1], argv[2:]
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))  # a regression is a MemoryError, not the OOM killer
    from revgraph.cli import main as cli

    for model in models:
        for command in ("grad", "jvp"):
            out = os.path.join(out_dir, f"{os.path.basename(model)}.{command}.onnx")
            err = io.StringIO()
            start = time.perf_counter()
            tracemalloc.start()
            try:
                with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                    try:
                        code = cli([command, model, "-o", out])
                    except SystemExit as exc:
                        code = exc.code
                    except MemoryError:
                        code = "MemoryError"
            finally:
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
            size = os.path.getsize(out) if os.path.exists(out) else None
            if size is not None:
                os.remove(out)
            print(json.dumps({"model": os.path.basename(model), "command": command, "code": code,
                              "stderr": err.getvalue(), "peak": peak, "bytes": size,
                              "seconds": round(time.perf_counter() - start, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
