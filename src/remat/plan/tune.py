"""Measured tuning, the planning half: which layouts to time, and which one wins.

The cost model predicts; on a noisy machine two layouts a few percent apart in prediction may
run in the other order. So `remat.plan(..., tune=remat.Tuner(model, batch, ...))` times a
few layouts side by side through the real runtime (`remat.apply.tune`) and keeps the fastest
measured. The candidates (`tune_candidates`), each predicted to fit the budget:

- the cost model's best few: the optimal plan at the budget, then the fastest distinct layouts
  of the optimal frontier (`remat.pareto`) that fit it;
- every recipe that fits: no recomputation, per-block checkpointing (``full``), sqrt(N)
  segments (``sqrt``), `torch.utils.checkpoint.checkpoint_sequential`'s layout with
  round(sqrt(L)) segments per chain of L blocks (the first ones recomputed, the last kept:
  ``checkpoint_sequential``), and every registered selective policy on every block.

Layouts that two sources give (same segments, same head) are timed once, named ``a = b``.
`choose` drops a candidate whose measured peak exceeds the budget, or that failed, and returns
the plan of the least measured median, recording everything in `remat.plan.types.Tuning`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from remat.measure.types import Profile
from remat.plan.available import fall_back
from remat.plan.budget import format_bytes
from remat.plan.head import priced_profile
from remat.plan.joins import chain_runs
from remat.plan.planners import STRATEGIES, make_plan, pareto, plan
from remat.plan.policies import POLICIES
from remat.plan.types import Plan, Segment, TunedCandidate, Tuning

__all__ = ["Candidate", "Measurement", "TuneBounds", "RECIPES", "tune_candidates", "choose",
           "sequential_segments", "recipe_plan", "DEFAULT_NUM_OPTIMAL"]

DEFAULT_NUM_OPTIMAL = 3
"""The cost model's plans to time: the optimum and the next-fastest distinct layouts that fit."""


def _recipes() -> tuple[str, ...]:
    return ("none", "full", "sqrt", "checkpoint_sequential", *(f"selective:{p}" for p in sorted(POLICIES)))


RECIPES = _recipes()
"""The recipe layouts tuning times where they fit (selective policies: those registered at import)."""


@dataclass(kw_only=True, frozen=True)
class Candidate:
    """A layout to time: its name and its plan (predicted to fit the budget)."""

    name: str
    plan: Plan


@dataclass(kw_only=True, frozen=True)
class Measurement:
    """What timing one candidate through the real runtime gave."""

    step_ms: tuple[float, ...] = ()
    """Its timed steps, one per round."""
    peak_bytes: int | None = None
    """The peak of one tracked step (None: not measured)."""
    device_peak_bytes: int | None = None
    """CUDA: the allocator's peak over that step (None elsewhere)."""
    error: str = ""
    """Why it could not run (an exception's text), or empty."""


@dataclass(kw_only=True, frozen=True)
class TuneBounds:
    """How long tuning times: whichever bound comes first, and what it spent."""

    max_steps: int
    max_seconds: float
    rounds: int
    seconds: float


def sequential_segments(profile: Profile) -> tuple[Segment, ...]:
    """`torch.utils.checkpoint.checkpoint_sequential`'s layout on each chain of L joined blocks
    (`remat.plan.joins.chain_runs`), with round(sqrt(L)) segments: segments of L // S blocks,
    the first S - 1 recomputed, the rest (the last segment and the remainder) kept."""
    out: list[Segment] = []
    for start, stop in chain_runs(profile):
        length = stop - start
        count = max(1, round(math.sqrt(length)))
        size = length // count
        recomputed = start + size * (count - 1)
        out += [Segment(start=a, stop=a + size, strategy="recompute") for a in range(start, recomputed, size)]
        out += [Segment(start=i, stop=i + 1, strategy="keep") for i in range(recomputed, stop)]
    return tuple(out)


def recipe_plan(profile: Profile, name: str, budget: int | None = None, head: str = "keep") -> Plan:
    """Recipe ``name`` of `RECIPES` (``budget`` sizes ``selective:knapsack``) as a plan, with the fall-backs of `remat.plan` for blocks that cannot run it."""
    if name == "checkpoint_sequential":
        segments = fall_back(profile, sequential_segments(profile))
    else:
        segments = fall_back(profile, STRATEGIES[name.split(":", 1)[0]](priced_profile(profile, head), name, budget))
    return make_plan(profile, segments, name, budget, head=head)


def _optimal_plans(profile: Profile, budget: int, head: str | None, count: int) -> list[Plan]:
    """The optimal plan at ``budget``, then the frontier's fitting plans, fastest first."""
    best = plan(profile, budget, head=head)
    fitting = [p for p in pareto(profile) if p.prediction.peak_bytes <= budget and head in (None, p.head)]
    fitting.sort(key=lambda p: (p.prediction.step_ms, p.prediction.peak_bytes))
    out = [best]
    for p in fitting:
        if len(out) >= count:
            break
        if all(_layout(p) != _layout(q) for q in out):
            out.append(dataclasses.replace(p, budget_bytes=budget, optimality=None))
    return out


def _layout(p: Plan) -> tuple[tuple[Segment, ...], str]:
    return p.segments, p.head


def tune_candidates(profile: Profile, budget: int, head: str | None = None,
                    num_optimal: int = DEFAULT_NUM_OPTIMAL, recipes: Sequence[str] = RECIPES) -> tuple[Candidate, ...]:
    """The layouts to time under ``budget`` (bytes): the cost model's ``num_optimal`` best, then
    every recipe of ``recipes`` whose predicted peak fits; one candidate per distinct layout.
    ``head``: the head strategy of every candidate (None: the optimal plans search it, recipes
    keep the head). ValueError when no plan fits (`remat.plan`'s error)."""
    if not isinstance(num_optimal, int) or isinstance(num_optimal, bool) or num_optimal < 1:
        raise ValueError(f"num_optimal={num_optimal!r} must be an integer >= 1 (the cost model's plans to time).")
    named = [("optimal" if i == 0 else f"optimal #{i + 1}", p)
             for i, p in enumerate(_optimal_plans(profile, budget, head, num_optimal))]
    for name in recipes:
        recipe = recipe_plan(profile, name, budget, head or "keep")
        if recipe.prediction.peak_bytes <= budget:
            named.append((name, recipe))
    by_layout: dict[tuple, list] = {}
    for name, p in named:
        by_layout.setdefault(_layout(p), [[], p])[0].append(name)
    return tuple(Candidate(name=" = ".join(names), plan=p) for names, p in by_layout.values())


def _dropped(measured: Measurement, budget: int) -> str:
    if measured.error:
        return f"failed: {measured.error}"
    if measured.peak_bytes is not None and measured.peak_bytes > budget:
        return (f"measured peak {format_bytes(measured.peak_bytes)} ({measured.peak_bytes} bytes) over the budget "
                f"of {format_bytes(budget)} ({budget} bytes)")
    if not measured.step_ms:
        return "not timed (the time bound ran out first)"
    return ""


def _median(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def _record(candidate: Candidate, measured: Measurement, budget: int) -> TunedCandidate:
    pred = candidate.plan.prediction
    return TunedCandidate(
        name=candidate.name, segments=candidate.plan.segments, head=candidate.plan.head,
        predicted_step_ms=pred.step_ms, predicted_peak_bytes=pred.peak_bytes,
        measured_step_ms=_median(measured.step_ms), measured_peak_bytes=measured.peak_bytes,
        device_peak_bytes=measured.device_peak_bytes, rounds=len(measured.step_ms), dropped=_dropped(measured, budget),
    )


def choose(candidates: Sequence[Candidate], measurements: Sequence[Measurement], budget: int,
           bounds: TuneBounds) -> Plan:
    """The plan of the candidate with the least measured median step time among those whose
    measured peak fits ``budget`` and that ran (of equal medians, the first: the cost model's
    order), carrying the `Tuning` record. ValueError when every candidate was dropped."""
    if len(candidates) != len(measurements) or not candidates:
        raise ValueError(f"{len(candidates)} candidates but {len(measurements)} measurements; give one each.")
    records = [_record(c, m, budget) for c, m in zip(candidates, measurements)]
    kept = [i for i, r in enumerate(records) if not r.dropped]
    if not kept:
        reasons = "; ".join(f"{r.name}: {r.dropped}" for r in records)
        raise ValueError(
            f"measured tuning found no candidate that runs within the budget of {format_bytes(budget)} ({budget} "
            f"bytes): {reasons}. Raise the budget, or plan without tuning (the prediction is then unchecked)."
        )
    best = min(kept, key=lambda i: (records[i].measured_step_ms, i))
    tuning = Tuning(candidates=tuple(records), winner=records[best].name, max_steps=bounds.max_steps,
                    max_seconds=bounds.max_seconds, rounds=bounds.rounds, seconds=bounds.seconds)
    return dataclasses.replace(candidates[best].plan, tuning=tuning)
