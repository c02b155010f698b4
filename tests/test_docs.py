"""Generated documentation stays in step with the code."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_op_coverage_is_up_to_date():
    spec = importlib.util.spec_from_file_location("gen_op_coverage", DOCS / "gen_op_coverage.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = gen.render()
    assert (DOCS / "op_coverage.md").read_text() == text, "run: python docs/gen_op_coverage.py"
    for op in ("Add", "MatMul", "Gather", "Loop", "If", "Scan"):
        assert f"| {op} | VJP rule |" in text


def test_train_synopsis_lists_the_registries():
    """The train guide's ``revgraph train`` synopsis and DESIGN.md's list the optimizers and losses of the registries
    the CLI reads (:data:`revgraph.train.optimizers.OPTIMIZERS`, :data:`revgraph.train.losses.LOSSES`)."""
    import re

    from revgraph.train.losses import LOSSES
    from revgraph.train.optimizers import OPTIMIZERS

    guide = (DOCS / "guides" / "train.md").read_text()
    synopsis = next(line for line in guide.splitlines() if line.startswith("## `revgraph train "))
    assert re.search(r"--optimizer ([\w|-]+)", synopsis).group(1) == "|".join(OPTIMIZERS)
    assert re.search(r"--loss-fn ([\w|:-]+)", synopsis).group(1) == "|".join(LOSSES)
    design = (DOCS / "DESIGN.md").read_text()
    assert re.search(r"revgraph train .*--optimizer ([\w|-]+)", design).group(1) == "|".join(OPTIMIZERS)


def test_grad_synopsis_lists_the_checkpoint_policies():
    """The differentiation guide's and DESIGN.md's ``--checkpoint`` lists are the CLI's
    (:data:`revgraph.autodiff.policies.NAMED`)."""
    from revgraph.cli.write import POLICIES

    for doc in (DOCS / "guides" / "differentiate.md", DOCS / "DESIGN.md"):
        assert f"[--checkpoint {POLICIES}]" in doc.read_text(), doc.name
