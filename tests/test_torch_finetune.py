"""A full fine-tune of a tiny LLaMA exported by ``revgraph.export_torch``, against PyTorch on the same data and
initial weights (issue 38): ``rg.Trainer(path, "causal-lm", adamw + cosine schedule with warmup + clipping)``
trains what the module trains (its parameters, not the rotary ``inv_freq``) and follows ``torch.optim.AdamW`` +
``transformers.get_cosine_schedule_with_warmup`` + ``clip_grad_norm_(1.0)`` step for step over 100 steps, the
embedding table included (torch's dense Adam update of every row)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kit import torch_models as tm  # (tests/ is on sys.path)

import revgraph as rg
from revgraph.train import adamw
from revgraph.train.schedules import Schedule

LR, WD, WARMUP, STEPS, BATCH, CLIP = 3e-3, 0.01, 10, 100, 4, 1.0
EMBEDDING = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The module (unperturbed: transformers' own initialization), its export_torch file, and the tokens."""
    module = tm.build("llama", perturb=False)
    path = tmp_path_factory.mktemp("finetune") / "llama.onnx"
    tm.export(module, "export_torch", path)
    return module, path, tm.tokens(STEPS * BATCH)


def _torch_run(module, ids: np.ndarray, frozen: tuple[str, ...]):
    """PyTorch's fine-tune: AdamW (weight decay on every parameter), HF's cosine schedule with warmup stepped
    after each optimizer step, clip_grad_norm_ before it; batches in order. Returns the losses and parameters."""
    model = copy.deepcopy(module)
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    from transformers import get_cosine_schedule_with_warmup

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    sched = get_cosine_schedule_with_warmup(opt, WARMUP, STEPS)
    losses = []
    for k in range(STEPS):
        x = torch.from_numpy(ids[k * BATCH:(k + 1) * BATCH])
        logits = model(x)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, tm.VOCAB), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses, {n: p.detach().numpy() for n, p in model.named_parameters()}


def _ours(path, ids: np.ndarray, frozen: tuple[str, ...]):
    opt = adamw(lr=LR, weight_decay=WD, schedule=Schedule("cosine", warmup_steps=WARMUP), clip_grad_norm=CLIP,
                no_decay="none")
    tr = rg.Trainer(str(path), "causal-lm", opt, freeze=list(frozen) or None)
    tr.fit({"input_ids": ids}, 1, BATCH, shuffle=False, progress=False)
    return tr


@pytest.mark.parametrize("frozen", [(), (EMBEDDING,)], ids=["all", "embedding frozen"])
def test_finetune_follows_torch_adamw_cosine_warmup_and_clipping(llama, frozen):
    module, path, ids = llama
    tr = _ours(path, ids, frozen)
    want = {n for n, _ in module.named_parameters()} - set(frozen)
    assert set(tr.parameters) == want and "model.rotary_emb.inv_freq" not in tr.parameters
    losses, params = _torch_run(module, ids, frozen)
    assert tr.steps == STEPS and len(tr.losses) == STEPS
    assert losses[-1] < 0.6 * losses[0]  # it learned: the comparison is of a run that moves
    np.testing.assert_allclose(tr.losses, losses, rtol=0, atol=1e-4)
    for n, value in tr.parameters.items():
        np.testing.assert_allclose(value, params[n], rtol=0, atol=2e-4, err_msg=n)
