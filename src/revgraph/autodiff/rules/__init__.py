"""VJP rules by op family. Importing this package registers every rule in :data:`registry.RULES`."""

from . import elementwise, reduce  # noqa: F401
