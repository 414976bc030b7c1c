"""Measured tuning at each recipe's own peak: the tuned plan against the recipe and against the
cost model's choice, timed side by side.

    .venv/bin/python -m benchmarks.tuning [--workloads gpt-small convnet mlp] [--steps 20]
                                          [--seconds 30] [--device cuda] [--markdown tuning.md]

Per workload: one profile; then, for every recipe layout that lowers the peak (`full`, `sqrt`,
`checkpoint_sequential`, the selective policies: `remat.plan.tune.RECIPES`), the budget is the
recipe's predicted peak and `remat.tune` times its candidates (the cost model's best three plans
and every recipe that fits, the recipe itself among them) in interleaved rounds, order rotated
each round, at most ``--steps`` timed steps each or ``--seconds`` of rounds. Reported: the
winner, the medians of the recipe, of the cost model's choice and of the winner from those
rounds, and a confirmation: the three timed again in fresh interleaved rounds (the same bound),
so that the winner's lead is not only the luck of the rounds that chose it.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch

import remat
from remat._files import write_atomic
from remat.apply.tune import Tuner
from remat.models import load_target
from remat.plan.tune import RECIPES, Candidate, recipe_plan, tune_candidates

WORKLOADS: dict[str, tuple[str, dict]] = {
    # issue 20's gpt small: 4 layers, d_model 128, seq 64, batch 8, vocab 512
    "gpt-small": ("gpt", dict(num_layers=4, d_model=128, num_heads=4, seq_len=64, batch_size=8, vocab_size=512)),
    "convnet": ("convnet", {}),
    "mlp": ("mlp", dict(depth=16, width=256, batch_size=256)),
    # issue 20's heterogeneous chains, as `benchmarks.peers` builds them (small)
    "resnet": ("convnet", dict(num_blocks=8, channels=16, image_size=32, batch_size=8, downsample_every=2)),
    "unet": ("unet", dict(depth=4, channels=16, image_size=64, batch_size=4)),
}


def _recipe_budgets(profile) -> list[tuple[str, int]]:
    """(recipe, its predicted peak) for every recipe whose peak is below no recomputation's."""
    top = remat.plan(profile, strategy="none").prediction.peak_bytes
    out = []
    for name in RECIPES:
        if name == "none" or name == "selective:knapsack":  # knapsack is sized to a budget, not a recipe
            continue
        peak = recipe_plan(profile, name).prediction.peak_bytes
        if peak < top:
            out.append((name, peak))
    return out


def _median_of(tuning, name: str) -> float | None:
    return next((c.measured_step_ms for c in tuning.candidates if name in c.name.split(" = ")), None)


def measure(workload: str, steps: int, seconds: float, device: str | None = None, sizes: dict | None = None) -> list[dict]:
    """Rows of one workload: one per recipe budget (module docstring)."""
    model_name, default_sizes = WORKLOADS.get(workload, (workload, {}))
    built = load_target(model_name, device=device, **(default_sizes if sizes is None else sizes))
    profile = remat.profile(built.model, built.batch, built.loss_fn, built.optimizer)
    tuner = Tuner(built.model, built.batch, built.loss_fn, built.optimizer, max_steps=steps, max_seconds=seconds)
    rows = []
    for recipe, budget in _recipe_budgets(profile):
        start = time.perf_counter()
        try:
            tuned = remat.plan(profile, budget, tune=tuner)
        except ValueError as error:  # the planner refuses a budget it could meet: shown, not hidden
            rows.append(dict(workload=workload, recipe=recipe, budget=budget, refused=str(error).splitlines()[0]))
            continue
        tuning = tuned.tuning
        by_name = {n: c for c in tune_candidates(profile, budget) for n in c.name.split(" = ")}
        again = [Candidate(name="winner", plan=tuned), by_name[recipe], by_name["optimal"]]
        confirm, _ = tuner.measure(again)
        medians = [sorted(m.step_ms)[len(m.step_ms) // 2] for m in confirm]
        rows.append(dict(
            workload=workload, recipe=recipe, budget=budget, winner=tuning.winner, candidates=len(tuning.candidates),
            rounds=tuning.rounds, recipe_ms=_median_of(tuning, recipe), optimal_ms=_median_of(tuning, "optimal"),
            winner_ms=_median_of(tuning, tuning.winner.split(" = ")[0]),
            predicted_winner_ms=tuned.prediction.step_ms, predicted_optimal_ms=by_name["optimal"].plan.prediction.step_ms,
            confirm_winner_ms=medians[0], confirm_recipe_ms=medians[1], confirm_optimal_ms=medians[2],
            dropped=sum(1 for c in tuning.candidates if c.dropped), seconds=time.perf_counter() - start,
            device=profile.environment.device_name,
        ))
    return rows


def markdown(rows: list[dict], steps: int, seconds: float) -> str:
    lines = [
        "| workload | budget = peak of | MiB | candidates | rounds | winner | recipe / optimal / winner ms (tuning "
        "rounds) | winner / recipe | confirmation: winner / recipe | winner / optimal |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['workload']} | {r['recipe']} | {r['budget'] / 2**20:.2f} | | | refused: {r['refused']} "
                         "| | | | |")
            continue
        lines.append(
            f"| {r['workload']} | {r['recipe']} | {r['budget'] / 2**20:.2f} | {r['candidates']} | {r['rounds']} | "
            f"{r['winner']} | {r['recipe_ms']:.1f} / {r['optimal_ms']:.1f} / {r['winner_ms']:.1f} | "
            f"{r['winner_ms'] / r['recipe_ms']:.2f} | {r['confirm_winner_ms'] / r['confirm_recipe_ms']:.2f} | "
            f"{r['confirm_winner_ms'] / r['confirm_optimal_ms']:.2f} |"
        )
    lines.append("")
    lines.append(
        f"Medians of interleaved rounds (order rotated each round), at most {steps} timed steps per candidate or "
        f"{seconds:g} s of rounds; confirmation: winner, recipe and optimal timed again the same way. torch "
        f"{torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads, {os.cpu_count()} cores"
        + "".join(f", {d}" for d in sorted({r['device'] for r in rows if 'device' in r})) + "."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: the CPU)")
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    rows = []
    for workload in args.workloads:
        start = time.perf_counter()
        rows += measure(workload, args.steps, args.seconds, args.device)
        print(f"{workload}: {time.perf_counter() - start:.0f} s", flush=True)
    text = markdown(rows, args.steps, args.seconds)
    print(text)
    if args.markdown:
        write_atomic(args.markdown, text + "\n")


if __name__ == "__main__":
    main()
