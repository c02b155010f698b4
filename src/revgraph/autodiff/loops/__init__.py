"""VJPs of control flow (DESIGN.md section 4): ``Loop`` (:mod:`.loop`, its residuals :mod:`.residuals`), checkpointed
loops (:mod:`.checkpoint`), the backward loop they share (:mod:`.reverse`), ``If`` (:mod:`.branch`); ``Scan``
(:mod:`.scan`) and ``LSTM``/``GRU``/``RNN`` (:mod:`.recurrent`) are differentiated as their ``Loop`` form
(:mod:`.lower`). Importing this package registers the rules."""

from . import branch, checkpoint, loop, recurrent, scan  # noqa: F401
