"""The four strategies estimate compares, priced by the planner's model on a built profile.

- ``none``: keep every layer's saved tensors;
- ``full``: recompute every layer (each layer its own checkpoint, holding its input);
- ``selective``: Megatron-LM's selective recomputation (Korthikanti et al. 2022): replay the
  attention core (QK^T, softmax, dropout, x V) and keep the rest (``selective:attention-core``);
  for a model without an explicit attention core (a fused attention kernel already stores no
  score matrix), ``selective:save-matmuls`` (keep matmul outputs, replay pointwise ops);
- ``optimal``: the planner's exact search for the fastest layout under the device budget.

Every strategy is priced by `remat.plan.predict`, so estimate and `remat plan` agree.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from remat.measure.types import Profile
from remat.plan.planners import make_plan, plan
from remat.plan.policies import has_attention_core
from remat.plan.search import OptimalSearch
from remat.plan.types import Plan

STRATEGY_NAMES = ("none", "full", "selective", "optimal")


@dataclass(kw_only=True, frozen=True)
class Priced:
    """One strategy's plan on one profile (the plan's prediction holds peak and time)."""

    strategy: str
    """``none``, ``full``, ``selective`` or ``optimal``."""
    plan: Plan
    """The layout and its prediction."""
    fits: bool
    """Predicted peak within the budget."""
    label: str
    """What ran: ``none``, ``full``, ``selective:attention-core``, ``optimal``; for ``optimal``
    also ``lowest peak`` (no layout fits; the least peak shown) or ``full (not searched)`` (model
    state alone exceeds the device, so the search is skipped and full recomputation shown)."""


def selective_policy(profile: Profile) -> str:
    """``selective:attention-core`` when the layers have an attention core, else ``save-matmuls``."""
    return "selective:attention-core" if has_attention_core(profile.blocks[0]) else "selective:save-matmuls"


def price(profile: Profile, strategy: str, budget_bytes: int, *, search: bool = True) -> Priced:
    """Plan and predict ``strategy`` on ``profile``; ``optimal`` searches under ``budget_bytes``
    (with ``search=False`` it shows the full-recomputation layout instead: used when model state
    alone exceeds the budget, where no layout fits)."""
    if strategy not in STRATEGY_NAMES:
        raise ValueError(f"unknown strategy {strategy!r}; allowed: {', '.join(STRATEGY_NAMES)}.")
    if strategy == "optimal":
        return _optimal(profile, budget_bytes) if search else _not_searched(profile, budget_bytes)
    name = selective_policy(profile) if strategy == "selective" else strategy
    result = plan(profile, None, name)
    return Priced(strategy=strategy, plan=result, fits=result.prediction.peak_bytes <= budget_bytes, label=name)


def _not_searched(profile: Profile, budget_bytes: int) -> Priced:
    result = plan(profile, None, "full")
    return Priced(strategy="optimal", plan=result, fits=result.prediction.peak_bytes <= budget_bytes,
                  label="full (not searched)")


def conservative(profile: Profile) -> Profile:
    """The profile without per-layer gradient bytes: the planner then counts every gradient as
    live through the whole backward (never less than the truth), and identical layers stay
    identical to its exact search, which is then O(N^2) instead of O(N^3) in the layers."""
    return replace(profile, blocks=tuple(replace(b, grad_bytes=0) for b in profile.blocks))


def _optimal(profile: Profile, budget_bytes: int) -> Priced:
    """Search under the conservative gradient model (`conservative`), then price the layout it
    finds with per-layer gradients: a layout that fits the former fits the latter. Only when
    nothing fits the conservative model does the slower search with per-layer gradients run."""
    search = OptimalSearch(conservative(profile))
    segments = search.best_segments(budget_bytes) if budget_bytes > 0 else None
    if segments is None and budget_bytes > 0:
        segments = OptimalSearch(profile).best_segments(budget_bytes)  # exact gradients: slower, rarer
    if segments is None:
        lowest = make_plan(profile, search.min_peak_segments(), "optimal", None)
        return Priced(strategy="optimal", plan=lowest, fits=lowest.prediction.peak_bytes <= budget_bytes,
                      label="lowest peak")
    result = make_plan(profile, segments, "optimal", budget_bytes)
    return Priced(strategy="optimal", plan=result, fits=result.prediction.peak_bytes <= budget_bytes, label="optimal")
