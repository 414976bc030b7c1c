"""The default jobs as data: profile once, plan, apply, verify (the CLI only renders).

- `run_job`: one model, one strategy at one budget (``remat run``).
- `verify_job`: a saved plan against a freshly built model (``remat verify plan.json``).
- `demo_job`: the built-in GPT, every strategy, optimal at three budgets (``remat demo``).

Each returns a `JobResult` holding the profile, the plans and their verifications, the seam
for a report (`remat.report.html.write_report(path, result.profile, result.plans, ...)`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from remat.measure.types import Profile
from remat.plan.types import Plan
from remat.verify_types import Verification

__all__ = ["JobRow", "JobResult", "run_job", "verify_job", "demo_job", "DEMO_SIZES", "DEMO_STRATEGIES",
           "DEMO_BUDGET_FRACTIONS"]

DEMO_MODEL = "gpt"
DEMO_SIZES: dict[str, Any] = {"num_layers": 6, "d_model": 64, "num_heads": 4, "seq_len": 64, "batch_size": 8}
"""Sized so the whole demo takes about a minute on 2 CPU cores, with activations (attention
scores above all) well above the model state, so budgets have room to act."""
DEMO_STRATEGIES = ("none", "full", "sqrt", "selective:attention-core", "selective:save-matmuls")
DEMO_BUDGET_FRACTIONS = (0.25, 0.5, 0.75)
"""Budgets of the optimal rows: this far from the least feasible peak to the baseline peak."""

Progress = Callable[[str], None]


@dataclass(kw_only=True, frozen=True)
class JobRow:
    """One plan of a job and what verify measured for it."""

    label: str
    """Row name, e.g. ``"optimal @ 50%"``."""
    plan: Plan
    verification: Verification


@dataclass(kw_only=True, frozen=True)
class JobResult:
    """What a job measured: the profile, and per plan its verification."""

    model_name: str
    sizes: dict[str, Any]
    profile: Profile
    rows: tuple[JobRow, ...]
    baseline: Plan
    """The ``none`` plan (its prediction is the baseline the percentages refer to)."""

    @property
    def plans(self) -> tuple[Plan, ...]:
        return tuple(r.plan for r in self.rows)

    @property
    def verifications(self) -> tuple[Verification, ...]:
        return tuple(r.verification for r in self.rows)

    @property
    def all_identical(self) -> bool:
        """True when every plan's gradients passed (bit-identical on the CPU)."""
        return all(v.ok for v in self.verifications)


def _quiet(_: str) -> None:
    return None


def _profile(model_name: str, sizes: dict[str, Any], progress: Progress, *, seed: int = 0,
             offload_dir: str | None = None) -> tuple[Any, Profile]:
    from remat._batch import model_device
    from remat.measure.bandwidth import measure_bandwidths
    from remat.measure.profile import profile
    from remat.models import load_target

    built = load_target(model_name, seed=seed, **sizes)
    progress(f"profiling {model_name}")
    prof = profile(built.model, built.batch, built.loss_fn, built.optimizer)
    if offload_dir is not None:
        progress(f"measuring transfer rates to {offload_dir}")
        prof = dataclasses.replace(prof, bandwidths=measure_bandwidths(model_device(built.model), offload_dir))
    return built, prof


def _verified(built: Any, plan: Plan, label: str, repeats: int, progress: Progress,
              offload_dir: str | None = None) -> JobRow:
    from remat.verify import verify

    progress(f"verifying {label}")
    result = verify(built.model, built.batch, plan, built.loss_fn, built.optimizer, repeats=repeats,
                    offload_dir=offload_dir)
    return JobRow(label=label, plan=plan, verification=result)


def baseline_peak(profile: Profile, baseline: Plan) -> int:
    """What a percentage budget is a share of: the measured baseline peak (else the predicted one)."""
    return profile.peak_bytes if profile.peak_bytes > 0 else baseline.prediction.peak_bytes


def run_job(model_name: str = DEMO_MODEL, *, budget: str | int | None = "40%", strategy: str = "optimal",
            sizes: dict[str, Any] | None = None, seed: int = 0, offload_dir: str | None = None,
            repeats: int = 3, progress: Progress = _quiet) -> JobResult:
    """Profile ``model_name``, plan ``strategy`` within ``budget`` (a share is of the measured
    baseline peak), apply it to a copy and verify it; the first row is the baseline.
    ``offload_dir``: measure the disk there, so the planner may offload to it."""
    from remat.plan.budget import parse_budget
    from remat.plan.planners import plan as make_plan

    sizes = dict(sizes or {})
    built, prof = _profile(model_name, sizes, progress, seed=seed, offload_dir=offload_dir)
    baseline = make_plan(prof, strategy="none")
    budget_bytes = None if budget is None else parse_budget(budget, baseline_peak(prof, baseline))
    chosen = make_plan(prof, budget=budget_bytes, strategy=strategy)
    label = strategy if budget is None else f"{strategy} @ {budget}"
    rows = (_verified(built, baseline, "none", repeats, progress),
            _verified(built, chosen, label, repeats, progress, offload_dir))
    return JobResult(model_name=model_name, sizes=sizes, profile=prof, rows=rows, baseline=baseline)


def verify_job(plan: Plan, model_name: str = DEMO_MODEL, *, sizes: dict[str, Any] | None = None, seed: int = 0,
               offload_dir: str | None = None, repeats: int = 3, progress: Progress = _quiet) -> JobResult:
    """Verify a saved ``plan`` on a freshly built ``model_name`` (same sizes and seed as when planned)."""
    from remat.plan.planners import plan as make_plan

    sizes = dict(sizes or {})
    built, prof = _profile(model_name, sizes, progress, seed=seed)
    row = _verified(built, plan, plan.strategy_name, repeats, progress, offload_dir)
    return JobResult(model_name=model_name, sizes=sizes, profile=prof, rows=(row,),
                     baseline=make_plan(prof, strategy="none"))


def demo_budgets(profile: Profile, baseline: Plan) -> list[int]:
    """The optimal rows' budgets: `DEMO_BUDGET_FRACTIONS` of the way from the floor to the baseline."""
    from remat.plan.planners import make_plan
    from remat.plan.search import OptimalSearch

    floor = make_plan(profile, OptimalSearch(profile).min_peak_segments(), "optimal", None).prediction.peak_bytes
    top = baseline.prediction.peak_bytes
    return [int(floor + f * (top - floor)) for f in DEMO_BUDGET_FRACTIONS]


def demo_job(*, model_name: str = DEMO_MODEL, sizes: dict[str, Any] | None = None, seed: int = 0,
             repeats: int = 3, progress: Progress = _quiet) -> JobResult:
    """Profile once; verify none, full, sqrt, two selective policies and optimal at three budgets."""
    from remat.plan.planners import plan as make_plan

    sizes = dict(DEMO_SIZES if sizes is None and model_name == DEMO_MODEL else sizes or {})
    built, prof = _profile(model_name, sizes, progress, seed=seed)
    baseline = make_plan(prof, strategy="none")
    plans: list[tuple[str, Plan]] = [(s, make_plan(prof, strategy=s)) for s in DEMO_STRATEGIES]
    for fraction, budget in zip(DEMO_BUDGET_FRACTIONS, demo_budgets(prof, baseline)):
        share = 100 * budget / baseline_peak(prof, baseline)
        plans.append((f"optimal @ {share:.0f}%", make_plan(prof, budget=budget, strategy="optimal")))
    rows = tuple(_verified(built, p, label, repeats, progress) for label, p in plans)
    return JobResult(model_name=model_name, sizes=sizes, profile=prof, rows=rows, baseline=baseline)
