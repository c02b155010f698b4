"""Memory of the backward pass: which forward values it reads (the residuals), their sizes, and the planner that
chooses what to keep and what to recompute under a budget (DESIGN.md section 7)."""

from .residuals import is_backward_node, residual_sizes, residuals, saved_bytes

__all__ = ["is_backward_node", "residual_sizes", "residuals", "saved_bytes"]
