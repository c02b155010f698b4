"""Learning-rate schedules for tests: Hugging Face's schedule functions as references."""

from __future__ import annotations

import math


def hf_lambda(kind: str, warmup: int, total: int, min_lr_rate: float = 0.0):
    """transformers.optimization's lr lambdas: get_constant_schedule_with_warmup, get_linear_schedule_with_warmup
    and get_cosine_with_min_lr_schedule_with_warmup (num_cycles 0.5); the linear one with the same min-lr rule."""
    def f(step: int) -> float:
        if step < warmup:
            return float(step) / float(max(1, warmup))
        if kind == "constant":
            return 1.0
        if kind == "linear":
            factor = max(0.0, float(total - step) / float(max(1, total - warmup)))
        else:
            progress = float(step - warmup) / float(max(1, total - warmup))
            factor = 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress))
        return max(0.0, factor * (1 - min_lr_rate) + min_lr_rate)
    return f
