"""The version of revgraph (its own module, so that writers of files need not import the package)."""

__version__ = "0.1.0"
