"""Random draws a replay cannot repeat: a block's own ``torch.Generator``, Python's ``random``
and NumPy's generator; and draws remat must not take from the caller (the batch's generators,
the host's generators across a profile).

A checkpoint restores the default generators' states around a replay, never a generator the
block passes to a random op itself: replayed, such a block draws other numbers and the gradients
differ with no error. The profile marks it keep-only, with the reason.
"""

from __future__ import annotations

import copy
import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.measure.types import OWN_GENERATOR
from remat.plan.available import check_available
from remat.plan.types import Segment

WIDTH = 8


class _Net(nn.Module):
    def __init__(self, block: type[nn.Module], n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(n))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        for b in self.blocks:
            x = b(x) if generator is None else b(x, generator)
        return self.head(x).pow(2).mean()


class _OwnGenerator(nn.Module):
    """Dropout whose mask comes from a generator the block holds."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.gen = torch.Generator().manual_seed(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        return x + h * (torch.rand(h.shape, generator=self.gen) < 0.5)


class _PassedGenerator(nn.Module):
    """The same mask, from a generator the batch passes in."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        return x + h * (torch.rand(h.shape, generator=generator) < 0.5)


class _DefaultGenerator(nn.Module):
    """The mask from the default generator, named: a checkpoint restores it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        return x + h * (torch.rand(h.shape, generator=torch.default_generator) < 0.5)


class _PythonRandom(nn.Module):
    """A scale drawn from Python's ``random`` and a mask from NumPy's generator."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x)) * random.uniform(0.5, 1.5)
        return x + h * torch.from_numpy((np.random.rand(*h.shape) < 0.5).astype(np.float32))


class _Branches(nn.Module):
    """Takes another path on some steps (a torch draw decides)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if bool(torch.rand(()) < 0.5):
            h = torch.tanh(torch.exp(h) - 1)
        return x + h


class _RandomLength(nn.Module):
    """The same operations on a length drawn at random (VITS's waveform: its duration predictor
    samples how long each token lasts)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        repeats = int(torch.randint(1, 4, ()))
        return x + torch.tanh(self.fc(x.repeat(repeats, 1))).view(repeats, *x.shape).mean(0)


def _model(block: type[nn.Module]) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _Net(block).train()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _x() -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1))


def test_a_block_drawing_from_its_own_generator_is_never_replayed() -> None:
    model, opt = _model(_OwnGenerator)
    prof = remat.profile(model, _x(), None, opt, warmup=0, repeats=1)
    for block in prof.blocks:
        for strategy in ("recompute", "selective:save-matmuls"):
            reason = block.unavailable_reason(strategy)
            assert reason is not None and reason.startswith(OWN_GENERATOR)
            assert "aten.rand.generator#0" in reason
        assert block.unavailable_reason("keep") is None
    with pytest.warns(UserWarning, match=r"block 'blocks.0' \(and 2 more\) cannot run 'recompute': its forward draws"):
        full = remat.plan(prof, strategy="full")
    assert full.block_strategies() == ("keep",) * 3
    assert all(s == "keep" for s in remat.plan(prof, budget=min(p.prediction.peak_bytes for p in remat.pareto(prof)))
               .block_strategies())
    with pytest.raises(ValueError, match="cannot run 'recompute': its forward draws from a torch.Generator of its own"):
        check_available(prof, (Segment(start=0, stop=3, strategy="recompute"),))


def test_the_replay_of_such_a_block_would_change_its_gradients() -> None:
    """What the unavailability guards against: the checkpoint's replay draws the generator's next numbers."""
    model, _ = _model(_OwnGenerator)
    x = _x()
    grads = []
    for checkpointed in (False, True):
        m = copy.deepcopy(model)
        y = x
        for b in m.blocks:
            y = torch.utils.checkpoint.checkpoint(b, y, use_reentrant=False) if checkpointed else b(y)
        m.head(y).pow(2).mean().backward()
        grads.append(m.blocks[0].fc.weight.grad)
    assert not torch.equal(*grads)


def test_a_generator_passed_in_the_batch_is_seen_too_and_verify_replays_it_for_both_runs() -> None:
    model, opt = _model(_PassedGenerator)
    gen = torch.Generator().manual_seed(3)
    batch = {"x": _x(), "generator": gen}
    before = gen.get_state()
    prof = remat.profile(model, batch, None, opt, warmup=0, repeats=1)
    assert torch.equal(gen.get_state(), before)  # the profile drew nothing the caller would miss
    assert all(b.unavailable_reason("recompute").startswith(OWN_GENERATOR) for b in prof.blocks)
    plan = remat.plan(prof, strategy="none")
    v = remat.verify(model, batch, plan, None, opt, repeats=1)
    # both runs draw the same masks from the batch's generator: identical, not "not deterministic"
    assert v.ok and v.grads_identical, v.tolerance_reason
    assert torch.equal(gen.get_state(), before)


def test_the_default_generator_named_is_restored_by_the_checkpoint_and_stays_replayable() -> None:
    model, opt = _model(_DefaultGenerator)
    prof = remat.profile(model, _x(), None, opt, warmup=0, repeats=1)
    assert all(b.unavailable_reason("recompute") is None for b in prof.blocks)
    v = remat.verify(model, _x(), remat.plan(prof, strategy="full"), None, opt, repeats=1)
    assert v.ok and v.grads_identical


def test_profile_leaves_pythons_and_numpys_generators_where_they_were() -> None:
    model, opt = _model(_PythonRandom)
    random.seed(5)
    np.random.seed(5)
    python, numpy = random.getstate(), np.random.get_state()[1].copy()
    remat.profile(model, _x(), None, opt, warmup=0, repeats=2)
    assert random.getstate() == python
    assert np.array_equal(np.random.get_state()[1], numpy)


def test_verify_says_when_the_plan_made_the_hosts_generators_draw_again() -> None:
    model, opt = _model(_PythonRandom)
    prof = remat.profile(model, _x(), None, opt, warmup=0, repeats=1)
    v = remat.verify(model, _x(), remat.plan(prof, strategy="full"), None, opt, repeats=1)
    assert not v.ok and v.grad_max_abs_diff > 0
    assert "drew other numbers from Python's random or NumPy's global generator" in v.tolerance_reason
    kept = remat.verify(model, _x(), remat.plan(prof, strategy="none"), None, opt, repeats=1)
    assert kept.ok and "drew other numbers" not in kept.tolerance_reason


def test_profile_warns_when_a_block_takes_another_path_in_a_later_step() -> None:
    model, opt = _model(_Branches)
    torch.manual_seed(0)  # block draws that take both paths over the profiled steps (probed: 2 of 3 blocks)
    with pytest.warns(UserWarning, match="ran other operations, or the same on other shapes, in a later profiled step"):
        remat.profile(model, _x(), None, opt, warmup=0, repeats=3)
    # the same operations on a length drawn at random: no warning before (VITS: its full
    # recomputation measured 57 % under its prediction, made from one draw)
    lengths, opt = _model(_RandomLength)
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="ran other operations, or the same on other shapes"):
        remat.profile(lengths, _x(), None, opt, warmup=0, repeats=3)
    steady, opt = _model(_DefaultGenerator)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remat.profile(steady, _x(), None, opt, warmup=0, repeats=3)
