"""How well `remat.predict` foresees step time and peak on every built-in model.

    .venv/bin/python -m benchmarks.time_model [--repeats 9] [--models gpt mlp convnet hf:gpt2 hf:llama]
                                             [--device cuda] [--markdown time-model.md]

Per model: `remat demo`'s job (`remat.apply.run.demo_job`) at the model's default sizes: one
profile, then none, full, sqrt, selective:attention-core, selective:save-matmuls and optimal at
three budgets, each verified by `remat.verify` with ``--repeats`` timed pairs (baseline, plan) in
swapped order. Reported per plan: predicted against measured peak, predicted and measured
overhead against no recomputation, and the step error at the speed of the baseline timed beside
the plan (`Verification.paired_step_error_pct`): the time model's error with the machine's drift
since profiling removed (that drift is given too). Target: peak within 2 %, step time within 10 %.
Hugging Face models are skipped when transformers is not installed.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

from remat.apply.run import demo_job
from remat._files import write_atomic
from remat.models.hf import transformers_available

MODELS = ("gpt", "mlp", "convnet", "hf:gpt2", "hf:llama")


def run(models: list[str], repeats: int, device: str | None = None) -> list[dict]:
    rows = []
    for name in models:
        if name.startswith("hf:") and not transformers_available():
            print(f"{name}: skipped (transformers is not installed)", flush=True)
            continue
        start = time.perf_counter()
        result = demo_job(model_name=name, repeats=repeats, device=device)
        for row in result.rows:
            v = row.verification
            rows.append(dict(model=name, plan=row.label, peak_error=v.peak_error_pct,
                             predicted_overhead=v.predicted_overhead_pct, measured_overhead=v.overhead_pct,
                             step_error=v.paired_step_error_pct, drift=v.baseline_drift_pct,
                             identical=v.grads_identical, ok=v.ok, tolerance=v.relative_tolerance,
                             max_rel=v.grad_max_rel_diff, baseline_ms=v.baseline_step_ms))
        print(f"{name}: {len(result.rows)} plans in {time.perf_counter() - start:.0f} s", flush=True)
    return rows


def _gradients(row: dict) -> str:
    """``identical``; within the plan's stated tolerance (a chunked head sums the loss in another
    order); else ``DIFFER``."""
    if row["identical"]:
        return "identical"
    if row.get("ok") and row.get("tolerance"):
        return f"within {row['tolerance']:.0e} (max {row['max_rel']:.1e})"
    return "DIFFER"


def markdown(rows: list[dict], repeats: int) -> str:
    lines = [
        "| model | plan | peak error | overhead predicted | overhead measured | step error (side by side) "
        "| baseline vs profile | gradients |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['plan']} | {r['peak_error']:+.1f}% | {r['predicted_overhead']:+.1f}% | "
            f"{r['measured_overhead']:+.1f}% | {r['step_error']:+.1f}% | {r['drift']:+.1f}% | "
            f"{_gradients(r)} |"
        )
    planned = [r for r in rows if r["plan"] != "none"]  # none is compared with itself: only noise
    within = sum(abs(r["step_error"]) <= 10 for r in planned)
    peaks = sum(abs(r["peak_error"]) <= 2 for r in rows)
    noise = [abs(r["measured_overhead"]) for r in rows if r["plan"] == "none"]
    lines.append("")
    lines.append(
        f"Step time within 10 %: {within} of {len(planned)} plans (median |error| "
        f"{statistics.median(abs(r['step_error']) for r in planned):.1f} %); peak within 2 %: {peaks} of "
        f"{len(rows)}. The none rows time the baseline against a copy of itself: |difference| "
        f"{min(noise):.1f} % to {max(noise):.1f} %, the noise floor of {repeats} pairs on this machine."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: the CPU)")
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    start = time.perf_counter()
    rows = run(args.models, args.repeats, args.device)
    text = markdown(rows, args.repeats)
    print(text)
    if args.markdown is not None:
        header = (
            "## Time and peak model against measurement (`benchmarks/time_model.py`)\n\n"
            f"Every built-in model at its default sizes, {args.repeats} timed pairs per plan; machine: "
            f"{platform.processor() or platform.machine()}, 2 shared cores (load average {os.getloadavg()[0]:.1f} "
            f"at the end), {time.perf_counter() - start:.0f} s in all. Command: `.venv/bin/python -m "
            f"benchmarks.time_model --repeats {args.repeats} --markdown time-model.md`.\n\n"
        )
        write_atomic(args.markdown, header + text + "\n")


if __name__ == "__main__":
    main()
