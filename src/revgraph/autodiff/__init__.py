"""Differentiation of graphs: the backward pass, the rule table, sparse gradients; forward mode (JVPs by
transposing VJPs), Hessian-vector products, Jacobians and Hessians."""

from .. import runtime as _runtime
from . import rules  # noqa: F401  (registers the VJP rules)
from .api import gradient
from .backward import backward
from .emitter import Emitter
from .forward import jvp
from .preview import DOMAIN as _PREVIEW_DOMAIN
from .preview import expand_gradient_ops
from .registry import NOT_DIFFERENTIABLE, RULES, vjp
from .sparse import SparseGrad
from .transforms import hessian, hvp, jacobian

_runtime.EXPANDERS[_PREVIEW_DOMAIN] = expand_gradient_ops

__all__ = ["NOT_DIFFERENTIABLE", "RULES", "Emitter", "SparseGrad", "backward", "expand_gradient_ops", "gradient",
           "hessian", "hvp", "jacobian", "jvp", "vjp"]
