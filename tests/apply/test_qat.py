"""Quantization-aware training (`torch.ao.quantization.prepare_qat`, the default fbgemm qconfig:
per-channel weight observers whose buffers start empty, moving-average activation observers).

The buffer guard learned which buffers a region changes from its first planned forward; a
weight observer whose min and max did not move there (weights as in the last forward) was
never guarded, so replays advanced the observers again from the second step on: other scales,
other gradients (1.9e-3 apart after 3 AdamW steps), and `verify`, comparing one step, passed.
The profile's restore could not copy an observer's empty buffer back (resized by the first
forward) and left the caller's optimizer stepped."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat

Q = pytest.importorskip("torch.ao.quantization")


def _qat_chain(warm: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3)])
    model.qconfig = Q.get_default_qat_qconfig("fbgemm")
    model.train()
    Q.prepare_qat(model, inplace=True)
    if warm:
        with torch.no_grad():
            model(torch.randn(8, 16))
    return model


def _loss(out, batch):
    return out.pow(2).mean()


def test_profile_gives_back_resized_observers_and_an_unstepped_optimizer():
    model = _qat_chain(warm=False)
    observer = model[0][0].weight_fake_quant.activation_post_process
    assert observer.min_val.shape == (0,)  # empty until the first forward
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prof = remat.profile(model, torch.randn(8, 16), _loss, opt, repeats=1)
    assert len(prof.blocks) == 3
    assert observer.min_val.shape == (0,) and len(opt.state) == 0
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("warm", [True, False], ids=["observers-warmed", "observers-empty"])
def test_a_plan_trains_qat_as_without_remat_observers_included(warm):
    x = torch.randn(8, 16)
    planned, plain = _qat_chain(warm), _qat_chain(warm)
    plan = remat.plan(remat.profile(copy.deepcopy(planned), x, _loss, repeats=1), strategy="full")
    assert plan.block_strategies() == ("recompute",) * 3
    remat.apply_(planned, plan)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (planned, plain)]
    for step in range(4):
        for model, opt in zip((planned, plain), optimizers):
            opt.zero_grad()
            _loss(model(x), x).backward()
        for (name, a), b in zip(planned.named_parameters(), plain.parameters()):
            assert torch.equal(a.grad, b.grad), (step, name)
        for (name, a), b in zip(planned.named_buffers(), plain.buffers()):
            assert torch.equal(a, b), (step, name)  # every observer advanced once per step
        for opt in optimizers:
            opt.step()
    remat.remove_(planned)
