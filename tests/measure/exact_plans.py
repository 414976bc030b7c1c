"""The check the forward-phase tests share: plans predicted to the byte, and the least-peak plan
within its own budget."""

from __future__ import annotations

from typing import Any

import torch

import remat
from remat.measure.types import Profile


def assert_plans_exact(model: torch.nn.Module, batch: Any, prof: Profile, optimizer: torch.optim.Optimizer,
                       strategies: tuple[str, ...] = ("none", "full"), least: bool = True, loss_fn: Any = None) -> None:
    """Every plan of ``strategies`` measured at its predicted peak, gradients bit-identical; with
    ``least``, the least-peak plan of `remat.pareto` within that peak."""
    for strategy in strategies:
        plan = remat.plan(prof, strategy=strategy)
        ver = remat.verify(model, batch, plan, loss_fn, optimizer=optimizer, repeats=1)
        assert ver.grads_identical, strategy
        assert plan.prediction.peak_bytes == ver.measured_peak_bytes, (strategy, plan.prediction.peak_bytes,
                                                                       ver.measured_peak_bytes)
    if least:
        lowest = min(p.prediction.peak_bytes for p in remat.pareto(prof))
        plan = remat.plan(prof, budget=lowest)
        assert remat.verify(model, batch, plan, loss_fn, optimizer=optimizer, repeats=1).measured_peak_bytes <= lowest
