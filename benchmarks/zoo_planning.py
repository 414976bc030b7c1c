"""Planning time on the model zoo: `remat.pareto` and `remat.plan` on every zoo model's profile.

    .venv/bin/python -m benchmarks.zoo_planning [--models bert t5 ...] [--rounds 3] [--markdown out.md]

The models are the test zoo's (`tests/zoo/zoo_models.py`), each profiled once with AdamW
(``repeats=1``: planning time does not depend on the timings). Per model, planning from cold
(`remat.plan.search.clear_planning_caches` before every call), the median of ``--rounds``
interleaved rounds, CPU seconds of this process: `remat.pareto`; `remat.plan` (``optimal``) at
the least feasible peak and half-way from there to no recomputation; ``selective:knapsack`` at the
half-way budget and at the least feasible peak (the budget it scans its targets furthest for).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "zoo"))

from remat._files import write_atomic  # noqa: E402
from remat.measure.profile import profile  # noqa: E402
from remat.measure.types import Profile  # noqa: E402
from remat.plan.planners import pareto, plan  # noqa: E402
from remat.plan.search import clear_planning_caches  # noqa: E402
from zoo_models import ZOO, build_zoo  # noqa: E402

COLUMNS = ("pareto", "optimal, least", "optimal, half-way", "knapsack, half-way", "knapsack, least")


def _calls(prof: Profile) -> dict[str, Callable[[], Any]]:
    frontier = pareto(prof)
    least, most = frontier[-1].prediction.peak_bytes, frontier[0].prediction.peak_bytes
    half = (least + most) // 2
    return {
        "pareto": lambda: pareto(prof),
        "optimal, least": lambda: plan(prof, least),
        "optimal, half-way": lambda: plan(prof, half),
        "knapsack, half-way": lambda: _knapsack(prof, half),
        "knapsack, least": lambda: _knapsack(prof, least),
    }


def _knapsack(prof: Profile, budget: int) -> Any:
    try:
        return plan(prof, budget, strategy="selective:knapsack")
    except ValueError:  # no knapsack layout fits: the scan went through every target
        return None


def measure(name: str, rounds: int) -> dict[str, Any]:
    """One row: blocks, frontier plans and the median CPU seconds of each call."""
    zoo = build_zoo(name)
    prof = profile(zoo.model, zoo.batch, zoo.loss_fn, zoo.optimizer, repeats=1)
    calls = _calls(prof)
    seconds: dict[str, list[float]] = {label: [] for label in calls}
    for _ in range(rounds):
        for label, call in calls.items():
            clear_planning_caches()
            start = time.process_time()
            call()
            seconds[label].append(time.process_time() - start)
    return {"model": name, "blocks": prof.num_blocks, "frontier_plans": len(pareto(prof)),
            **{label: statistics.median(values) for label, values in seconds.items()}}


def markdown(rows: list[dict[str, Any]], rounds: int) -> str:
    lines = ["| model | blocks | frontier plans | " + " | ".join(f"{c}: CPU s" for c in COLUMNS) + " |",
             "| --- | ---: | ---: | " + " | ".join("---:" for _ in COLUMNS) + " |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['blocks']} | {r['frontier_plans']} | "
                     + " | ".join(f"{r[c]:.2f}" for c in COLUMNS) + " |")
    lines.append("")
    lines.append(f"Median of {rounds} interleaved round(s), planning from cold; torch {torch.__version__}, "
                 f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(ZOO), choices=list(ZOO))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    rows = [measure(name, args.rounds) for name in args.models]
    text = markdown(rows, args.rounds)
    print(text)
    if args.markdown:
        write_atomic(args.markdown, text + "\n")


if __name__ == "__main__":
    main()
