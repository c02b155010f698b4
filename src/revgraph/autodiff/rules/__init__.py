"""VJP rules by op family. Importing this package registers every rule in :data:`registry.RULES`."""

from . import elementwise, indexing, linalg, nn, reduce, shape  # noqa: F401
from .. import loops  # noqa: F401  (Loop, Scan and If)
