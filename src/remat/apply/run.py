"""The default jobs as data: profile once, plan, apply, verify (the CLI only renders).

- `run_job`: one model, one strategy at one budget (``remat run``).
- `verify_job`: a saved plan against a freshly built model (``remat verify plan.json``).
- `demo_job`: the built-in GPT, every strategy, optimal at three budgets (``remat demo``).

Each returns a `JobResult` holding the profile, the plans and their verifications;
`write_outputs` saves them as JSON next to the self-contained HTML report
(`remat.report.html.write_report`), in ``./remat-out/`` unless told otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from remat.measure.types import Profile
from remat.plan.types import Plan
from remat.verify_types import Verification

__all__ = ["JobRow", "JobResult", "JobFiles", "run_job", "verify_job", "demo_job", "output_files", "write_outputs", "DEMO_SIZES",
           "DEMO_STRATEGIES", "DEMO_BUDGET_FRACTIONS", "DEFAULT_OUT_DIR"]

DEMO_MODEL = "gpt"
DEMO_SIZES: dict[str, Any] = {}
"""The built-in GPT at its default sizes (`remat.models.gpt.GPTConfig`): activations (attention
scores above all) far above the model state, so budgets have room to act, and the whole demo
takes about a minute on 2 CPU cores."""
DEMO_STRATEGIES = ("none", "full", "sqrt", "selective:attention-core", "selective:save-matmuls")
DEMO_BUDGET_FRACTIONS = (0.25, 0.5, 0.75)
"""Budgets of the optimal rows: this far from the least feasible peak to the baseline peak."""
DEFAULT_OUT_DIR = Path("remat-out")
"""Where `remat run` and `remat demo` write their JSON files and report (``run/``, ``demo/``)."""

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
    budget_bytes: int | None = None
    """The budget the report judges the plans by (run: the one asked for; demo: the middle one)."""
    repeats: int = 5
    """Timed pairs (baseline, plan) per row."""
    budget_note: str = ""
    """Why the plan's budget is not the one asked for ("": it is; `run_job`'s ``raise_to_floor``)."""

    @property
    def plans(self) -> tuple[Plan, ...]:
        return tuple(r.plan for r in self.rows)

    @property
    def verifications(self) -> tuple[Verification, ...]:
        return tuple(r.verification for r in self.rows)

    @property
    def all_identical(self) -> bool:
        """True when every plan's gradients passed (bit-identical on the CPU, or within a chunked
        head's stated tolerance)."""
        return all(v.ok for v in self.verifications)


def _quiet(_: str) -> None:
    return None


def _profile(model_name: str, sizes: dict[str, Any], progress: Progress, *, seed: int = 0,
             offload_dir: str | None = None, device: str | None = None,
             dtype: torch.dtype | None = None) -> tuple[Any, Profile]:
    from remat._batch import model_device
    from remat.measure.bandwidth import with_bandwidths
    from remat.measure.profile import profile
    from remat.models import load_target

    built = load_target(model_name, seed=seed, device=device, dtype=dtype, **sizes)
    progress(f"profiling {model_name}")
    prof = profile(built.model, built.batch, built.loss_fn, built.optimizer)
    if offload_dir is not None:
        progress(f"measuring transfer rates to {offload_dir}")
        prof = with_bandwidths(prof, model_device(built.model), offload_dir)
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
            repeats: int = 5, progress: Progress = _quiet, device: str | None = None,
            dtype: torch.dtype | None = None, tune: bool = False, tune_steps: int = 20,
            tune_seconds: float = 30.0, raise_to_floor: bool = False) -> JobResult:
    """Profile ``model_name``, plan ``strategy`` within ``budget`` (a share is of the measured
    baseline peak), apply it to a copy and verify it; the first row is the baseline.
    ``offload_dir``: measure the disk there, so the planner may offload to it. ``device``: where
    the model and batch run, ``dtype``: their floating dtype (`remat.models.load_target`; None:
    where and as they were built). ``tune``: time the candidates side by side on the model and
    keep the fastest measured (`remat.apply.tune.Tuner`, at most ``tune_steps`` timed steps per
    candidate or ``tune_seconds`` of rounds). ``raise_to_floor``: a budget below the least peak
    any plan reaches is raised to it, the reason in ``budget_note`` (`remat run` without
    ``--budget``: its default share is chosen without knowing the model; a budget given is never
    raised)."""
    from remat.distributed import broadcast_plan, world_size
    from remat.plan.budget import parse_budget
    from remat.plan.planners import plan as make_plan

    sizes = dict(sizes or {})
    built, prof = _profile(model_name, sizes, progress, seed=seed, offload_dir=offload_dir, device=device,
                           dtype=dtype)
    baseline = make_plan(prof, strategy="none")
    budget_bytes = None if budget is None else parse_budget(budget, baseline_peak(prof, baseline))
    note = ""
    if raise_to_floor and budget_bytes is not None and strategy == "optimal":
        from remat.plan.planners import min_peak_plan
        from remat._units import format_bytes

        floor = min_peak_plan(prof).prediction.peak_bytes
        if budget_bytes < floor:
            note = (f"the default budget {budget} ({format_bytes(budget_bytes)}) is below the least peak any plan "
                    f"reaches on this model, {format_bytes(floor)}: planned at that peak (pass --budget to choose)")
            if floor >= baseline.prediction.peak_bytes:
                note += ("; no plan lowers this model's peak: what sets it (the model state, the part outside the "
                         "blocks) is the same in every plan")
            budget_bytes = floor
    tuner = None
    if tune:
        from remat.apply.tune import Tuner

        progress("timing candidate plans")
        tuner = Tuner(built.model, built.batch, built.loss_fn, built.optimizer, max_steps=tune_steps,
                      max_seconds=tune_seconds, offload_dir=offload_dir)
    chosen = make_plan(prof, budget=budget_bytes, strategy=strategy, tune=tuner)
    if world_size() > 1:  # under torchrun every rank applies rank 0's plans
        baseline, chosen = broadcast_plan(baseline), broadcast_plan(chosen)
    label = strategy if budget is None else f"{strategy} @ {budget}" if not note else f"{strategy} @ least peak"
    label += ", tuned" if tune else ""
    rows = (_verified(built, baseline, "none", repeats, progress),
            _verified(built, chosen, label, repeats, progress, offload_dir))
    return JobResult(model_name=model_name, sizes=sizes, profile=prof, rows=rows, baseline=baseline,
                     budget_bytes=budget_bytes, repeats=repeats, budget_note=note)


def verify_job(plan: Plan, model_name: str = DEMO_MODEL, *, sizes: dict[str, Any] | None = None, seed: int = 0,
               offload_dir: str | None = None, repeats: int = 5, progress: Progress = _quiet,
               device: str | None = None) -> JobResult:
    """Verify a saved ``plan`` on a freshly built ``model_name`` (same sizes, seed and device as
    when planned)."""
    from remat.plan.planners import plan as make_plan

    sizes = dict(sizes or {})
    built, prof = _profile(model_name, sizes, progress, seed=seed, device=device)
    row = _verified(built, plan, plan.strategy_name, repeats, progress, offload_dir)
    return JobResult(model_name=model_name, sizes=sizes, profile=prof, rows=(row,),
                     baseline=make_plan(prof, strategy="none"), repeats=repeats)


def demo_budgets(profile: Profile, baseline: Plan, fractions: Sequence[float] = DEMO_BUDGET_FRACTIONS) -> list[int]:
    """The optimal rows' budgets: ``fractions`` of the way from the floor to the baseline."""
    from remat.plan.planners import min_peak_plan

    floor = min_peak_plan(profile).prediction.peak_bytes
    top = baseline.prediction.peak_bytes
    return sorted({int(floor + f * (top - floor)) for f in fractions})  # one row when floor == top


def demo_job(*, model_name: str = DEMO_MODEL, sizes: dict[str, Any] | None = None, seed: int = 0,
             repeats: int = 5, progress: Progress = _quiet, device: str | None = None,
             strategies: Sequence[str] = DEMO_STRATEGIES,
             budget_fractions: Sequence[float] = DEMO_BUDGET_FRACTIONS) -> JobResult:
    """Profile once; verify each of ``strategies`` (default: none, full, sqrt, two selective
    policies) and optimal at each of ``budget_fractions`` (`demo_budgets`)."""
    from remat.plan.planners import plan as make_plan

    sizes = dict(DEMO_SIZES if sizes is None and model_name == DEMO_MODEL else sizes or {})
    built, prof = _profile(model_name, sizes, progress, seed=seed, device=device)
    baseline = make_plan(prof, strategy="none")
    plans: list[tuple[str, Plan]] = [(s, make_plan(prof, strategy=s)) for s in strategies]
    budgets = demo_budgets(prof, baseline, budget_fractions)
    for budget in budgets:
        share = 100 * budget / baseline_peak(prof, baseline)
        plans.append((f"optimal @ {share:.0f}%", make_plan(prof, budget=budget, strategy="optimal")))
    rows = tuple(_verified(built, p, label, repeats, progress) for label, p in plans)
    return JobResult(model_name=model_name, sizes=sizes, profile=prof, rows=rows, baseline=baseline,
                     budget_bytes=budgets[len(budgets) // 2] if budgets else None, repeats=repeats)


@dataclass(kw_only=True, frozen=True)
class JobFiles:
    """What `write_outputs` wrote."""

    report: Path
    """The self-contained HTML report."""
    profile: Path
    plans: tuple[Path, ...]
    """One plan JSON per row of the job, in row order."""
    verifications: tuple[Path, ...]
    """One Verification JSON per row, in row order."""


def file_stem(label: str) -> str:
    """A row label as a file-name part: ``"optimal @ 40%"`` -> ``"optimal-40pct"``."""
    text = label.replace("%", "pct").replace(":", "-")
    return re.sub(r"[^A-Za-z0-9.-]+", "-", text).strip("-") or "plan"


def _unique(stems: list[str]) -> list[str]:
    """Stems made unique by their row number where two rows share one."""
    return [stem if stems.count(stem) == 1 else f"{i}-{stem}" for i, stem in enumerate(stems)]


def output_files(result: JobResult, out_dir: str | Path) -> JobFiles:
    """The paths `write_outputs` writes ``result`` to under ``out_dir`` (nothing is written)."""
    out = Path(out_dir)
    stems = _unique([file_stem(row.label) for row in result.rows])
    return JobFiles(report=out / "report.html", profile=out / "profile.json",
                    plans=tuple(out / f"plan-{stem}.json" for stem in stems),
                    verifications=tuple(out / f"verification-{stem}.json" for stem in stems))


def write_outputs(result: JobResult, out_dir: str | Path, *, commands: Sequence[str] = ()) -> JobFiles:
    """Write ``profile.json``, ``plan-<row>.json`` and ``verification-<row>.json`` per row, and
    ``report.html`` (with the optimal frontier and ``commands``, which reproduce it) under ``out_dir``."""
    from remat.plan.planners import pareto
    from remat.report.html import write_report

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output directory {str(out)!r} is a file; pass a directory, e.g. --out remat-out.")
    out.mkdir(parents=True, exist_ok=True)
    files = output_files(result, out)
    for row, plan_path, ver_path in zip(result.rows, files.plans, files.verifications):
        row.plan.save(plan_path)
        row.verification.save(ver_path)
    result.profile.save(files.profile)
    report = write_report(files.report, result.profile, result.plans, result.verifications,
                          commands=commands, frontier=pareto(result.profile), budget_bytes=result.budget_bytes)
    return replace(files, report=report)
