"""The goals docs/benchmarks.md checks (issue 18, "Performance, round two"), evaluated on the results of one
bench/run.py run: each goal is a measured value and the limit it must not exceed. report.py renders them with
a run before the changes as *before*; report_hotspots.py lists the ones missed.

- training step <= 0.8x the faster of PyTorch eager and JAX jit at batch 64, <= 1.0x at batch 1, 1 and 2
  threads, every model;
- the optimizer update (Adam step minus forward-and-backward step, per turn) costs no more than PyTorch's;
- build time <= 0.5x onnxruntime-training's on every graph both build, and under 40 us per node for the 10k chain;
- ``sqrt`` loop checkpointing <= 1.4x the time of ``store`` at T = 10,000.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from report_format import MODEL_NAMES, _r, contended

STEP_GOAL = 0.8        # revgraph step / the faster of PyTorch eager and JAX jit, batch 64
STEP_GOAL_SMALL = 1.0  # the same at batch 1
UPDATE_GOAL = 1.0      # revgraph's optimizer update cost / PyTorch's
BUILD_GOAL = 0.5       # revgraph build time / onnxruntime-training build time
CHAIN_US_GOAL = 40.0   # µs per forward node to build the 10k chain's gradient
SQRT_GOAL = 1.4        # sqrt checkpointing time / store time, T = 10,000


@dataclass(frozen=True)
class Goal:
    name: str
    value: float | None  # the measured ratio (or µs per node)
    limit: float
    unit: str = "x"  # "x": a ratio; "µs": microseconds per node
    note: str = ""   # why the value is unreliable, when it may be

    @property
    def met(self) -> bool | None:
        return None if self.value is None else self.value <= self.limit

    def show(self, value: float | None = None) -> str:
        v = self.value if value is None else value
        if v is None:
            return "–"
        return f"{v:.2f}x" if self.unit == "x" else f"{v:.0f} µs"

    def verdict(self) -> str:
        if self.met is None:
            return "–"
        text = "yes" if self.met else f"no: {self.value / self.limit:.2f}x the limit"
        return text + (f" (unreliable: {self.note})" if self.note else "")


def _threads(n: int) -> str:
    return f"{n} thread{'s' if n > 1 else ''}"


def update_ms(entry: dict, framework: str) -> float | None:
    """The optimizer update's time: timed alone (the update graph, ``optimizer.step()``) when the run did, else
    the median over turns of (whole optimizer step - forward-and-backward step), timed in the same turn."""
    if entry.get("update_ms", {}).get(framework):
        return entry["update_ms"][framework]
    t = entry.get("times", {})
    whole, grad = t.get(f"{framework} adam"), t.get(f"{framework} grad")
    if not whole or not grad:
        return None
    return 1e3 * statistics.median(a - b for a, b in zip(whole, grad, strict=False))


def goals(res: dict) -> list[Goal]:
    """Every goal the run measured, in the order of the issue."""
    out = []
    steps = res.get("steps", {})
    for batch, limit in ((64, STEP_GOAL), (1, STEP_GOAL_SMALL)):
        for e in steps.get("grad", []):
            if e["batch"] != batch:
                continue
            others = [t for fw, t in e["ms"].items() if fw != "revgraph" and t]
            best = min(others) if others else None
            out.append(Goal(f"training step ≤ {limit}x the faster of PyTorch and JAX: {MODEL_NAMES[e['model']]}, "
                            f"batch {batch}, {_threads(e['threads'])}", _r(e["ms"].get("revgraph"), best), limit,
                            note=contended(res, e)))
    for e in steps.get("adam", []):
        rg, pt = update_ms(e, "revgraph"), update_ms(e, "pytorch")
        value = rg / pt if rg is not None and rg > 0 and pt and pt > 0 else None  # <= 0: within the noise
        out.append(Goal(f"Adam update ≤ PyTorch's: {MODEL_NAMES[e['model']]}, batch {e['batch']}, "
                        f"{_threads(e['threads'])}", value, UPDATE_GOAL,
                        note="" if e.get("update_ms") else "the difference of two whole steps"))
    for c in res.get("build", {}).get("cases", []):
        if c.get("ratio") is not None:
            out.append(Goal(f"build ≤ 0.5x onnxruntime-training: {c['name']}"
                            + (" (adapted model)" if c.get("compared_on") == "adapted" else ""),
                            c["ratio"], BUILD_GOAL))
        if c.get("name") == "chain 10k" and c.get("revgraph_s"):
            out.append(Goal("build of the 10k chain < 40 µs per node", 1e6 * c["revgraph_s"] / c["nodes"],
                            CHAIN_US_GOAL, unit="µs"))
    loops = {(r["steps"], r["policy"]): r for r in res.get("memory", {}).get("loops", [])}
    store, sqrt = loops.get((10000, "store")), loops.get((10000, "sqrt"))
    if store and sqrt:
        out.append(Goal("`sqrt` checkpointing ≤ 1.4x `store`'s time, T = 10,000", _r(sqrt["time_s"], store["time_s"]),
                        SQRT_GOAL))
    return out
