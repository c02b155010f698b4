"""The shipped light models (onnx's backend data) with their constants lifted to random trainable weights."""

from __future__ import annotations

from conftest import DATA_DIR, random_weights

import revgraph as rg
from revgraph.autodiff.lift import lift_constants

#: the light models (tests/conftest.py's DATA_DIR/light)
MODELS = ["resnet50", "inception_v1", "inception_v2", "densenet121", "shufflenet", "squeezenet", "vgg19",
          "zfnet512", "bvlc_alexnet"]


def lifted(name: str) -> tuple[rg.Graph, list[str]]:
    """Light model ``name`` with its constants lifted to weights (random, seed 0), and the lifted names."""
    g, names = lift_constants(rg.load(DATA_DIR / "light" / f"light_{name}.onnx"))
    return random_weights(g, 0), names
