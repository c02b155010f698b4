"""Data-parallel training: the engines over ``torch.distributed`` (:mod:`.data_parallel`), the gradient exchange
(:mod:`.exchange`, :mod:`.overlap`), sharded optimizer state and gradients (:mod:`.sharding`), synchronized batch
normalization, and the launchers (:mod:`.launch` for torchrun, :mod:`.ray_launcher` for Ray Train)."""
