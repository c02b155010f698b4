"""The ONNX backend node tests as gradient checks.

The onnx wheel ships the generators of its backend node tests (``onnx.backend.test.case.node``: each
``export*`` function builds a one-node model and its inputs through ``expect``; ``collect_testcases`` runs them
all). For every test whose graph is one node of an operator revgraph differentiates (a VJP rule in
``revgraph.autodiff.registry.RULES``, or a rewrite into a Loop, ``LOWERED``) with a floating-point input and a
floating-point output, :func:`revgraph.check_gradients` compares the gradient of each float output with float64
central differences, with respect to every float input, at the test's own inputs.

* Inputs that set the output's shape (ONNX shape inference knows the output shape only once the input's value
  is known: ``Resize`` scales, ``OneHot`` depth, axes, pads, ...) become initializers, as exported models hold
  them; the others stay graph inputs.
* Inputs that sit exactly on a kink or a jump of the function (``Relu`` at 0, tied ``Max`` inputs, a
  bound of ``Clip``, a float index at an integer), on a point where the output's shape jumps, or next to a
  singularity (``Acosh`` at 1, ``Pow`` of 0 by a negative exponent) cannot be checked by differences: the check
  says so (:data:`revgraph.tools.check.NOT_CHECKED`, or "not finite"), and the test moves them by ~1e-3 (relative)
  and checks there, with a :class:`NudgedWarning` naming them.
* Each test runs at its own opset when that is 21 or newer (revgraph keeps a model's opset, up to the newest the
  installed onnx knows); an older one is converted up to 21 by ``onnx.version_converter``, as :func:`revgraph.load`
  does.
* Skipped, with the reason: NaN or infinite data; a dtype onnxruntime's Python API cannot feed (float8, int4,
  float4, int2, ...); an opset newer than onnxruntime runs; an old model that ``onnx.version_converter`` cannot
  convert up to opset 21, or whose declared inputs the conversion changes so that the test's data no longer fits
  (Scan-8's batch axis).
* A real gradient bug, or a gradient revgraph refuses, is an ``xfail(strict=True)`` naming it
  (:data:`KNOWN_BUGS`), so that its fix shows.

A deterministic sample (:data:`SAMPLED`, a tenth: ~85 tests) runs with the suite; ``pytest -m slow
tests/test_node_suite.py`` runs them all (~950).
"""

from __future__ import annotations

import warnings
import zlib

import numpy as np
import pytest
from kit.node_cases import CASES, NAMES, feedable, prepare

import revgraph as rg
from revgraph.tools.check import NOT_CHECKED

SAMPLE_MODULUS = 10
#: node tests whose gradient revgraph refuses to build or gets wrong: name -> what is missing or wrong.
#: The section 2 bugs of issue 13 that this suite also finds (Clip with min > max, Dropout's ratio, ScatterND
#: and ScatterElements with reduction mul/max/min) are fixed by their own changes, not marked here.
KNOWN_BUGS = {
    "test_convtranspose_output_shape": "ConvTranspose with an output_shape larger than the convolution produces "
                                       "(negative padding): revgraph refuses its VJP",
}

#: node tests whose data sit where the function has no derivative, which central differences cannot see (they
#: report a mismatch, not a non-finite value): the inputs are moved off the singularity first, as for kinks
SINGULAR = {
    "test_l2normalization_axis_0": "x holds a zero vector along axis 0, where x / ||x|| jumps (revgraph's "
                                   "gradient there is 0 by convention, docs/op_coverage.md)",
}
#: node tests whose gradient the float64 check cannot run, with why
UNCHECKABLE = {
    "test_mvn": "MeanVarianceNormalization in float64: onnxruntime has a float32 kernel only, and the reference "
                "evaluator's function body adds a float32 epsilon to a float64 value (tests/test_rules_norm.py "
                "checks the rule on the gradient graph alone)",
    **{f"test_dynamicquantizelinear{k}": "DynamicQuantizeLinear in float64: onnxruntime has a float32 kernel only, "
       "and the reference evaluator computes the scale in float32 (tests/test_nondifferentiable_audit.py checks the "
       "rule against float64 differences of the spec's formulas at these tests' inputs)"
       for k in ("", "_max_adjusted", "_min_adjusted")},
}


class NudgedWarning(UserWarning):
    """A node test's inputs sat on a kink or jump of the function and were moved before checking."""


#: the feedable tests whose name hashes to 0 modulo SAMPLE_MODULUS: about 85, spread over the operators, and the
#: same tests whatever rules are added (each test's membership depends on its name only)
SAMPLED = [n for n in NAMES if zlib.crc32(n.encode()) % SAMPLE_MODULUS == 0 and feedable(CASES[n])]


def nudged(feeds: dict[str, np.ndarray], names: list[str], attempt: int) -> dict[str, np.ndarray]:
    """``feeds`` with inputs ``names`` moved up by 1e-3 to 2e-3 of max(1, |x|) per element (distinct amounts,
    so ties break; upwards, so a ratio at 0 stays inside its domain)."""
    rng = np.random.default_rng(100 + attempt)
    out = dict(feeds)
    for k in names:
        x = feeds[k].astype(np.float64)
        out[k] = x + 1e-3 * (1 + rng.random(x.shape)) * np.maximum(1.0, np.abs(x))
    return out


def check_case(name: str) -> None:
    """Check every float output's gradient of node test ``name`` (module doc)."""
    if name in UNCHECKABLE:
        pytest.skip(UNCHECKABLE[name])
    prep = prepare(CASES[name])
    for loss in prep.losses:
        feeds, moved = prep.feeds, []
        if name in SINGULAR:
            feeds, moved = nudged(prep.feeds, prep.wrt, 3), list(prep.wrt)
        for attempt in range(4):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "no path" for inputs a rule does not differentiate
                rep = rg.check_gradients(prep.graph, loss, prep.wrt, inputs=feeds)
            unchecked = [r.name for r in rep.rows if r.status in (*NOT_CHECKED, "not finite")]
            if not unchecked or attempt == 3:
                break
            moved = sorted(set(moved) | set(unchecked))
            feeds = nudged(prep.feeds, moved, attempt)
        if rep.rows and all(r.status == "not finite" for r in rep.rows):
            continue  # an output holding -inf (masked attention scores) everywhere nearby: no loss to differentiate
        if moved and name not in SINGULAR:
            warnings.warn(f"{name}: {', '.join(moved)} sat on a kink, a jump or a singularity of {loss!r}; checked "
                          "at inputs moved by ~1e-3", NudgedWarning, stacklevel=2)
        bad = [f"{r.name}: {r.status} (abs {r.max_abs:.3g}, rel {r.max_rel:.3g}) {r.note}" for r in rep.rows
               if r.status != "agree"]
        assert not bad, f"{name}, loss {loss!r} ({rep.backend}; {'; '.join(rep.notes)}): " + "; ".join(bad)


def _params(names: list[str], *marks) -> list:
    return [pytest.param(n, id=n, marks=[*marks, *([pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[n])]
                                                   if n in KNOWN_BUGS else [])]) for n in names]


@pytest.mark.parametrize("name", _params(SAMPLED))
def test_node_gradient_sample(name):
    check_case(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", _params(NAMES))
def test_node_gradient(name):
    check_case(name)
