"""Training: losses, optimizers, schedules and precision as graph nodes; the training graphs built from them
(:mod:`.graphs`: :func:`training_graph`, :func:`split_step`, ...); the engines that run them (:mod:`.engines`),
the :class:`~.trainer.Trainer`, training snapshots (:mod:`.snapshots`), LoRA and data-parallel training
(:mod:`.distributed`). ``revgraph.train`` itself exports the training graphs' API, as it always has."""

from .graphs import *  # noqa: F403  (the public API of revgraph.train: graphs.__all__)
from .graphs import __all__ as __all__
