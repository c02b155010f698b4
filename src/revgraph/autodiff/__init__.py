"""Reverse-mode differentiation of graphs: the backward pass, the rule table, sparse gradients."""

from . import rules  # noqa: F401  (registers the VJP rules)
from .backward import backward, gradient
from .registry import NOT_DIFFERENTIABLE, RULES, Emitter, vjp
from .sparse import SparseGrad

__all__ = ["NOT_DIFFERENTIABLE", "RULES", "Emitter", "SparseGrad", "backward", "gradient", "vjp"]
