"""VJP rules by op family. Importing this package registers every rule in :data:`registry.RULES`."""

from .. import loops  # noqa: F401  (Loop, Scan and If)
from . import (  # noqa: F401
    activations,
    attention,  # Attention, RotaryEmbedding
    conv,
    elementwise,
    indexing,
    linalg,
    loss,
    nn,
    norm,
    pool,
    quant,  # QuantizeLinear -> DequantizeLinear with the straight-through estimator
    reduce,
    sampling,  # GridSample, AffineGrid
    sequence,  # SequenceAt, SplitToSequence, ConcatFromSequence, ...
    shape,
    spectral,  # DFT, STFT
)
