"""Forward mode on the exported architectures of tests/kit/zoo.py: revgraph's JVP against ``torch.func.jvp``.

The JVP graph takes a random tangent for every parameter matched to the module and for every floating-point
graph input (an image, audio features); ``torch.func.jvp`` differentiates ``functional_call(module, params,
inputs)`` along the same tangents in float64. PyTorch's CPU flash-attention kernel has no forward-mode derivative,
so the reference runs SDPA's math kernel. The error is norm-relative over the first output.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

import revgraph as rg
from kit.zoo import Case, Float64, export, match_parameters, run


def compare_jvp(case: Case, exporter: str, opset: int, rtol: float = 1e-6) -> float:
    """The norm-relative error of revgraph's JVP of ``case``'s first output (AssertionError beyond ``rtol``)."""
    data, module, inputs = export(case, exporter, opset)
    g = rg.load(data)
    out = g.output_names[0]
    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    matched = match_parameters(g, params)
    float_inputs = [(k, vi.name) for k, vi in enumerate(g.inputs) if inputs[k].is_floating_point()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jg = rg.jvp(g, outputs=[out], inputs=[*sorted(matched), *(n for _, n in float_inputs)])
    rng = np.random.default_rng(5)
    feeds = {vi.name: t.numpy() for vi, t in zip(g.inputs, inputs, strict=True)}
    tangents = {i: rng.standard_normal(np.shape(g.initializers[i])) for i in matched}
    tangents.update({n: rng.standard_normal(feeds[n].shape) for _, n in float_inputs})
    feeds.update({f"{name}_tangent": t for name, t in tangents.items()})
    got = run(jg, feeds)[jg.output_names[-1]]
    names = [matched[i] for i in sorted(matched)]
    positions = [k for k, _ in float_inputs]

    def f(*args):
        ps, xs = args[: len(names)], args[len(names):]
        call = list(inputs)
        for k, x in zip(positions, xs, strict=True):
            call[k] = x
        return functional_call(module, dict(zip(names, ps, strict=True)), tuple(call))

    primals = [params[n].detach() for n in names] + [inputs[k] for k in positions]
    tans = [torch.tensor(tangents[i]) for i in sorted(matched)] + [torch.tensor(tangents[n]) for _, n in float_inputs]
    with Float64(), sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        _, want = torch.func.jvp(f, tuple(primals), tuple(tans))
    want = want.numpy()
    err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))
    assert err <= rtol, f"{case.name}/{exporter}/{opset}: JVP off by {err:.2e} (norm-relative)"
    return err
