"""VJPs of control flow (DESIGN.md section 4): ``Loop`` (:mod:`.loop`), checkpointed loops
(:mod:`.checkpoint`), ``If`` (:mod:`.branch`) and ``Scan``, differentiated as its ``Loop`` form (:mod:`.scan`).
Importing this package registers the rules."""

from . import branch, checkpoint, loop, scan  # noqa: F401
