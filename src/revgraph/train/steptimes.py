"""Per-phase timings of training steps (``revgraph train --profile``, ``rg.Trainer(profile=True)``) and the
timeline of a step's segments and collectives (bench/ddp.py ``--profile``).

A step has three phases, timed with ``time.perf_counter`` on the calling process (rank 0 prints them):

- ``forward+backward``: the grad graph's runs (all segments, all micro-batches) and what the engine does
  between them on the step's path (scaling and summing gradients, starting each bucket's all-reduce);
- ``exchange``: the time the step waited for the gradient exchange after the backward pass: the waits for the
  bucket all-reduces that were still running and the all-gather of sparse rows. With overlap, the part of
  an all-reduce that ran during the backward pass is not in it (the timeline shows it);
- ``update``: the update graph's run.

The timeline records events ``{"kind", "name", "start", "end"}`` in seconds from the start of the step: one
``segment`` per segment run (compute), one ``all-reduce`` per bucket from the call that started it to its
completion (a callback on the work's future, so the end is when the collective finished, not when it was
waited for), and the phases themselves.
"""

from __future__ import annotations

import statistics
import time

PHASES = ("forward+backward", "exchange", "update")


class StepTimes:
    """Timings of every step (:data:`PHASES`, seconds) and, with ``timeline=True``, the events of each step."""

    def __init__(self, timeline: bool = False):
        self.steps: list[dict[str, float]] = []
        self.timelines: list[list[dict]] = [] if timeline else None
        self._t0 = 0.0

    def begin(self) -> None:
        """A step starts now."""
        self._t0 = time.perf_counter()
        self.steps.append(dict.fromkeys(PHASES, 0.0))
        if self.timelines is not None:
            self.timelines.append([])

    def now(self) -> float:
        return time.perf_counter()

    def add(self, phase: str, start: float) -> None:
        """Add the time since ``start`` (a :meth:`now`) to ``phase`` of the current step."""
        if self.steps:
            self.steps[-1][phase] += time.perf_counter() - start

    def event(self, kind: str, name: str, start: float, end: float | None = None) -> dict | None:
        """Record an event of the current step (``end`` None: now); returns it (its ``end`` may be set later)."""
        if self.timelines is None or not self.timelines:
            return None
        e = {"kind": kind, "name": name, "start": start - self._t0,
             "end": (time.perf_counter() if end is None else end) - self._t0}
        self.timelines[-1].append(e)
        return e

    def finish(self, e: dict | None) -> None:
        """Set the end of event ``e`` to now (called from a collective's completion callback)."""
        if e is not None:
            e["end"] = time.perf_counter() - self._t0

    def medians(self, skip: int = 0) -> dict[str, float]:
        """Median seconds of each phase and of their sum (``"step"``) over the steps after the first ``skip``."""
        rows = self.steps[skip:] or self.steps
        if not rows:
            return {}
        out = {p: statistics.median(r[p] for r in rows) for p in PHASES}
        out["step"] = statistics.median(sum(r.values()) for r in rows)
        return out

    def summary(self) -> str:
        """One line: ``"forward+backward 1.23 ms, exchange 0.45 ms, update 0.12 ms (median over N steps)"``."""
        m = self.medians()
        if not m:
            return "no steps were timed"
        parts = ", ".join(f"{p} {1e3 * m[p]:.3f} ms" for p in PHASES)
        return f"{parts}; step {1e3 * m['step']:.3f} ms (medians over {len(self.steps)} steps)"
