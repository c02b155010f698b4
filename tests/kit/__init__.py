"""Helpers shared by test modules (no test module imports another test module's names: what two need is here)."""
