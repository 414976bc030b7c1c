"""A model that changes its own structure on its first forward (BigBird-Pegasus swaps its
block-sparse attention modules for full ones at a sequence too short for them): the profile
measures the changed model; the model it was given, now changed, and a copy never run both take
the plan."""

from __future__ import annotations

import copy

import torch
from torch import nn

import remat
from remat.measure.fingerprint import model_hash
from remat.plan.types import Plan


class SwitchesOnce(nn.Module):
    """A residual unit whose activation module is replaced on its first forward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.act: nn.Module = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.act, nn.ReLU):
            self.act = nn.Tanh()  # as set_attention_type("original_full") replaces modules
        return x + self.act(self.lin(x))


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SwitchesOnce(8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def test_the_profiled_model_and_a_copy_never_run_both_take_the_plan(tmp_path) -> None:
    torch.manual_seed(0)
    model, x = Chain(), torch.randn(4, 8)
    fresh = copy.deepcopy(model)
    given = model_hash(model)
    plan = remat.plan(remat.profile(model, (x,)), strategy="full")
    assert plan.fingerprint.model_hash == given != model_hash(model) == plan.fingerprint.run_model_hash
    plan.save(tmp_path / "plan.json")
    plan = Plan.load(tmp_path / "plan.json")
    ver = remat.verify(model, (x,), plan, repeats=1)
    assert ver.ok and ver.grads_identical and ver.measured_peak_bytes == plan.prediction.peak_bytes
    reference = copy.deepcopy(fresh)
    remat.apply_(fresh, plan)  # never run: becomes the profiled model on its first forward
    fresh(x).backward()
    reference(x).backward()
    for p, q in zip(fresh.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    remat.apply_(model, plan)


def test_a_model_that_keeps_its_structure_records_no_second_hash() -> None:
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(3)))
    prof = remat.profile(model, (torch.randn(4, 8),), loss_fn=lambda out, batch: out.square().mean())
    assert prof.fingerprint.run_model_hash == ""
