"""Memory of the backward pass: which forward values it reads (the residuals), their sizes, and the planner that
chooses what to keep and what to recompute under a budget (DESIGN.md section 7)."""

from .budget import Budget, as_budget, parse_budget
from .plan import ORT_DISABLED_OPTIMIZERS, REMAT_PREFIX, MemoryPlan, plan_memory
from .residuals import is_backward_node, residual_sizes, residuals, saved_bytes

__all__ = ["ORT_DISABLED_OPTIMIZERS", "REMAT_PREFIX", "Budget", "MemoryPlan", "as_budget", "is_backward_node",
           "parse_budget", "plan_memory", "residual_sizes", "residuals", "saved_bytes"]
