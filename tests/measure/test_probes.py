"""Probes that never crash the profile: a strategy whose probe raises on a block is marked
unavailable there, with the reason; the rest is measured, and no plan picks it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import remat
from remat.measure.probes import Attempts, failure_reason
from remat.measure.types import Profile
from remat.plan.planners import plan

WIDTH = 8


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) + x


class _NoSelective(_Plain):
    """Runs plainly and under plain checkpointing; raises under selective checkpointing's
    dispatch mode, as a block using an op torch cannot cache would."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(_get_current_dispatch_mode()).__name__ == "_CachingTorchDispatchMode":
            raise RuntimeError("this block cannot run under selective checkpointing\nsecond line")
        return super().forward(x)


class _Alternating(_Plain):
    """Takes the other branch on every call (a Python-side schedule, as a layer-drop rule may):
    a replay then runs other ops than the forward it replays."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x) if self.calls % 2 else torch.sin(x)  # saves 2 tensors, or 1


class _NeedsAGraph(_Plain):
    """Fails when its input is a leaf: run alone on its captured (detached) input it cannot run."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.grad_fn is None:
            raise ValueError("input without history")
        return super().forward(x)


class _Net(nn.Module):
    def __init__(self, middle: type[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Plain(), middle(), _Plain()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 1.0  # the blocks' inputs have a history in the model
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _profiled(middle: type[nn.Module]) -> tuple[nn.Module, torch.Tensor, Profile]:
    torch.manual_seed(0)
    model, batch = _Net(middle), torch.randn(16, WIDTH)
    return model, batch, remat.profile(model, batch, blocks="blocks.*", repeats=1)


@pytest.mark.slow
def test_a_block_whose_selective_probe_raises_is_profiled_planned_without_it_and_verified():
    model, batch, prof = _profiled(_NoSelective)
    assert [b.unavailable for b in prof.blocks] == [
        (), (("selective", "RuntimeError: this block cannot run under selective checkpointing"),), ()]
    assert prof.blocks[1].recompute_overhead_ms >= 0 and prof.blocks[1].fwd_ms > 0  # the rest is measured
    assert Profile.from_json(prof.to_json()).blocks[1].unavailable == prof.blocks[1].unavailable
    chosen = plan(prof, strategy="selective:save-matmuls")
    assert chosen.block_strategies() == ("selective:save-matmuls", "recompute", "selective:save-matmuls")
    check = remat.verify(model, batch, chosen, repeats=1)
    assert check.grads_identical and check.recompute_counts_match
    for budget in (plan(prof, strategy="full").prediction.peak_bytes, prof.peak_bytes):
        assert all(s.kind != "selective" for s in plan(prof, budget=budget).segments[1:2])


def test_a_block_a_replay_cannot_repeat_is_kept():
    model, batch, prof = _profiled(_Alternating)
    marked = dict(prof.blocks[1].unavailable)
    assert sorted(marked) == ["recompute", "selective"]
    assert marked["recompute"].startswith("CheckpointError: torch.utils.checkpoint: ")  # the replay saved otherwise
    assert prof.blocks[0].unavailable == () and prof.blocks[2].unavailable == ()
    chosen = plan(prof, strategy="full")
    assert chosen.block_strategies() == ("recompute", "keep", "recompute")
    least = plan(prof, budget=plan(prof, strategy="full").prediction.peak_bytes)
    assert least.block_strategies()[1] == "keep"
    check = remat.verify(model, batch, chosen, repeats=1)
    assert check.grads_identical and check.recompute_counts_match


def test_a_block_that_cannot_run_alone_has_both_strategies_marked():
    _, _, prof = _profiled(_NeedsAGraph)
    reason = "the block run alone on its captured inputs raised ValueError: input without history"
    assert prof.blocks[1].unavailable == (("recompute", reason), ("selective", reason))
    assert (prof.blocks[1].recompute_overhead_ms, prof.blocks[1].selective_overhead_ms) == (0.0, 0.0)
    assert plan(prof, strategy="sqrt").block_strategies()[1] == "keep"


def test_attempts_keep_the_first_failure_of_each_strategy_and_skip_the_rest():
    attempts, calls = Attempts(), []

    def boom(n: int) -> int:
        calls.append(n)
        raise KeyError(f"missing {n}")

    assert attempts.run("a", boom, 1) is None and attempts.run("a", boom, 2) is None
    assert attempts.run("b", lambda: 7) == 7
    assert calls == [1] and attempts.failed() == {"a": "KeyError: 'missing 1'"}
    assert failure_reason(RuntimeError("x" * 400)) == "RuntimeError: " + "x" * 283 + "..."
    assert failure_reason(RuntimeError()) == "RuntimeError"
    with pytest.raises(KeyboardInterrupt):  # not a probe's failure: the user stops the profile
        attempts.run("c", lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
