"""A block whose forward is a Python loop of small ops (a reference kernel: BailingHybrid's and
Kimi Linear's linear attention in PyTorch) has hundreds of cacheable call groups: the knapsack
offers the `MAX_KNAPSACK_GROUPS` of most replay time and says what it leaves out."""

from __future__ import annotations

import torch
from torch import nn

import remat
from remat.cli.profile import state_summary
from remat.plan.policies import MAX_KNAPSACK_GROUPS, _group_subsets, knapsack_frontier, knapsack_left_out_ms


class Loop(nn.Module):
    """``steps`` rounds of a scale and a tanh: each call's output its own storage, so its own group."""

    def __init__(self, width: int, steps: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(steps, width) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for s in self.scale:
            x = torch.tanh(x * s)
        return x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Loop(32, 40) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def test_a_block_of_many_groups_offers_the_costliest_and_plans_exactly() -> None:
    torch.manual_seed(0)
    model, x = Net(), torch.randn(16, 32)
    prof = remat.profile(model, (x,))
    block = prof.blocks[0]
    groups = _group_subsets(block)
    assert len(groups) == 80 > MAX_KNAPSACK_GROUPS  # 40 multiplies and 40 tanh, one storage each
    times = [op.time_ms for op in block.ops]
    worth = sorted((sum(times[i] for i in g[-1][1]) for g in groups), reverse=True)
    whole = knapsack_frontier(block)[-1]  # every offered group cached
    offered = {block.ops.index(op) for op in block.ops if op.key in whole[2]}
    assert len({g[-1][1] for g in groups if set(g[-1][1]) <= offered}) == MAX_KNAPSACK_GROUPS
    assert abs(sum(times[i] for i in offered) - sum(worth[:MAX_KNAPSACK_GROUPS])) < 1e-9
    assert abs(knapsack_left_out_ms(block) - sum(worth[MAX_KNAPSACK_GROUPS:])) < 1e-9
    assert "selective:knapsack offers the 64 call groups of most replay time of a block; 2 block(s)" in state_summary(prof)
    least = min(p.prediction.peak_bytes for p in remat.pareto(prof))
    for budget in (least, (least + remat.plan(prof, strategy="none").prediction.peak_bytes) // 2):
        plan = remat.plan(prof, budget=budget)
        ver = remat.verify(model, (x,), plan, repeats=1)
        assert ver.grads_identical and ver.recompute_counts_match
        assert ver.measured_peak_bytes == plan.prediction.peak_bytes <= budget


def test_a_block_of_few_groups_offers_them_all() -> None:
    torch.manual_seed(0)
    model, x = Net(), torch.randn(16, 32)
    for block in model.blocks:
        block.scale = nn.Parameter(block.scale[:20].detach().clone())
    block = remat.profile(model, (x,)).blocks[0]
    assert len(_group_subsets(block)) == 40 and knapsack_left_out_ms(block) == 0.0
    assert "call groups" not in state_summary(remat.profile(model, (x,)))
