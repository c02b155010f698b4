"""Training-mode BatchNormalization in data-parallel training (revgraph.sync_batchnorm).

Without ``sync_batchnorm`` each rank normalizes over its own share of the global batch: rank 0 warns, naming
the nodes. With it the statistics are those of the global batch, and 2 gloo processes under torchrun equal one
process on the same global batches (rtol 2e-5), the running statistics included; 37 samples in global batches
of 12 leave a last batch of 1 sample, so rank 1 has none.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch.distributed.run", reason="distributed training needs torch (revgraph[distributed])")

from sync_batchnorm_worker import bn_model, data, trainer  # noqa: E402  (tests/ is on sys.path)
from test_distributed import TORCHRUN, _port, _run  # noqa: E402

from pathlib import Path  # noqa: E402

from revgraph.runtime import Session  # noqa: E402

WORKER = Path(__file__).parent / "sync_batchnorm_worker.py"
SAMPLES, BATCH, EPOCHS = 37, 6, 2


def _torchrun(out: Path, *extra: str) -> list[dict]:
    _run([*TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
          str(_port()), str(WORKER), "--out", str(out), "--samples", str(SAMPLES), "--batch-size", str(BATCH),
          "--epochs", str(EPOCHS), *extra])
    ranks = [dict(np.load(out / f"rank{r}.npz")) for r in range(2)]
    for name in ranks[0]:  # the ranks are replicas
        np.testing.assert_array_equal(ranks[1][name], ranks[0][name], err_msg=name)
    return ranks


def _single(optimizer: str):
    tr = trainer(optimizer, False)
    tr.fit(data(SAMPLES), EPOCHS, 2 * BATCH, seed=3, progress=False)
    return tr


def test_per_rank_statistics_warn_with_the_node_names(tmp_path):
    ranks = _torchrun(tmp_path)
    warned = (tmp_path / "warnings0.txt").read_text()
    assert "BatchNormalization 'bn_conv', 'bn_fc'" in warned and "--sync-batchnorm" in warned
    assert "BatchNormalization" not in (tmp_path / "warnings1.txt").read_text()  # rank 0 only
    ref = _single("adam").parameters
    # what the warning is about: per-rank statistics train differently from one process
    assert max(np.max(np.abs(ranks[0][k] - v)) for k, v in ref.items()) > 1e-3


def test_evaluation_uses_the_running_statistics():
    tr = trainer("adam", False)
    tr.fit(data(SAMPLES), 1, 8, progress=False)
    before = tr.parameters
    a, b = tr.evaluate(data(SAMPLES), batch_size=5), tr.evaluate(data(SAMPLES), batch_size=SAMPLES)
    for k, v in tr.parameters.items():  # evaluating does not write the running statistics
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)  # and does not depend on the evaluation batch
    # the model in inference mode (BatchNormalization with one output, no training_mode) with the trained values,
    # run by onnxruntime, and the cross-entropy in numpy
    g = bn_model()
    g.initializers.update(before)
    for node in g.nodes:
        if node.op_type == "BatchNormalization":
            node.attrs.pop("training_mode")
            node.outputs = node.outputs[:1]
    d = data(SAMPLES)
    logits = Session(g).run({"x": d["x"]}, ["logits"])["logits"].astype(np.float64)
    logp = logits - logits.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    assert b["loss"] == pytest.approx(-logp[np.arange(SAMPLES), d["labels"]].mean(), rel=1e-5)
