"""``python -m revgraph``: the command line, also as torchrun starts it (``torchrun ... -m revgraph train ...``)."""

import sys

from .cli import main
from .train.distributed.launch import leave_worker

code = main()
leave_worker(code)  # (a torchrun or --nproc worker's refusal: no interpreter finalization, see leave_worker)
sys.exit(code)
