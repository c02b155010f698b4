"""``python -m revgraph``: the command line, also as torchrun starts it (``torchrun ... -m revgraph train ...``)."""

import sys

from .cli import main

sys.exit(main())
