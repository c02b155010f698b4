"""VJP rules by op family. Importing this package registers every rule in :data:`registry.RULES`."""

from .. import loops  # noqa: F401  (Loop, Scan and If)
from . import (  # noqa: F401
    activations,
    attention,  # Attention
    contrib_embed,  # com.microsoft EmbedLayerNormalization
    contrib_fused,  # com.microsoft Gelu, BiasGelu, FastGelu, QuickGelu, BiasAdd, FusedMatMul
    contrib_gqa,  # com.microsoft GroupQueryAttention
    contrib_mha,  # com.microsoft MultiHeadAttention, Attention
    # com.microsoft SkipLayerNormalization, SkipSimplifiedLayerNormalization; SimplifiedLayerNormalization
    contrib_norm,
    contrib_quant,  # com.microsoft MatMulNBits (a frozen base)
    contrib_rotary,  # com.microsoft RotaryEmbedding
    conv,  # Conv, ConvTranspose
    deform,  # DeformConv, Col2Im
    dropout,
    elementwise,
    indexing,
    linalg,
    loss,
    ml_linear,  # ai.onnx.ml LinearClassifier, LinearRegressor, Normalizer
    norm,
    pool,
    quant,  # QuantizeLinear -> DequantizeLinear with the straight-through estimator
    reduce,
    resize,
    roi,  # MaxUnpool, MaxRoiPool, RoiAlign
    rotary,  # RotaryEmbedding
    sampling,  # GridSample, AffineGrid
    scatter,  # ScatterND, ScatterElements
    sequence,  # SequenceAt, SplitToSequence, ConcatFromSequence, ...
    shape,
    softmax,
    spectral,  # DFT, STFT
    unique,  # Unique
)
