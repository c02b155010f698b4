"""VJP rules by op family. Importing this package registers every rule in :data:`registry.RULES`."""

from . import activations, conv, elementwise, indexing, linalg, loss, nn, norm, pool, reduce, shape  # noqa: F401
from . import attention  # noqa: F401  (Attention, RotaryEmbedding)
from .. import loops  # noqa: F401  (Loop, Scan and If)
