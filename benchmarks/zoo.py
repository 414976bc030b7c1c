"""The model zoo as a table: how remat sees each model, the least peak it reaches against Hugging
Face's own checkpointing, and how close its predicted peaks are to the measured ones.

    .venv/bin/python -m benchmarks.zoo [--models bert t5 ...] [--repeats 3]
                                       [--json zoo.json] [--markdown zoo.md]

The models are the test zoo's (`tests/zoo/zoo_models.py`: tiny Hugging Face models built from
configs, random weights, no download, and the built-in U-Net), each with AdamW. Per model: one
profile (``--repeats`` timed steps), then, verified by `remat.verify` (gradients against no
recomputation, the peak measured by the device-agnostic tracker):

- the least feasible plan (the last plan of `remat.pareto`) and the plan half-way from there to no
  recomputation (each with the head strategy the planner chose: `remat.plan.head`): predicted
  against measured peak; gradients identical, or within a chunked head's stated tolerance;
- the measured peak of a training step (forward, loss, backward, AdamW step, after one step that
  creates the optimizer state, as `remat.verify` measures) without recomputation and with Hugging
  Face's ``gradient_checkpointing_enable()`` (non-reentrant, every layer checkpointed), where the
  model supports it.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

# the zoo lives with the tests, at the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "zoo"))

from remat.measure.profile import _Step, profile  # noqa: E402
from remat._files import write_atomic
from remat.measure.tracker import track_step  # noqa: E402
from remat.plan.planners import pareto  # noqa: E402
from remat.verify import verify  # noqa: E402
from zoo_models import ZOO, ZooModel, build_zoo  # noqa: E402

MIB = 2**20


def step_peak_bytes(zoo: ZooModel, hf_checkpointing: bool) -> int:
    """Measured peak of a training step on a copy of the model (after one step that creates the
    optimizer state), with or without Hugging Face's gradient checkpointing."""
    model = copy.deepcopy(zoo.model)
    if hf_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = _Step(model, zoo.batch, zoo.loss_fn, optimizer)
    torch.manual_seed(0)
    step.run()
    torch.manual_seed(0)
    return track_step(step.run, model=model, optimizer=optimizer, batch=zoo.batch).peak_bytes


def measure(name: str, repeats: int) -> dict[str, Any]:
    """One row of the table (bytes, percents, seconds)."""
    start = time.perf_counter()
    zoo = build_zoo(name)
    prof = profile(zoo.model, zoo.batch, zoo.loss_fn, zoo.optimizer, repeats=repeats)
    frontier = pareto(prof)
    least, most = frontier[-1], frontier[0]
    half = min(frontier, key=lambda p: abs(p.prediction.peak_bytes - (least.prediction.peak_bytes
                                                                       + most.prediction.peak_bytes) / 2))
    checks = {label: verify(zoo.model, zoo.batch, p, zoo.loss_fn, zoo.optimizer, repeats=repeats)
              for label, p in (("least", least), ("half-way", half))}
    return {
        "model": name,
        "stacks": [[s.name, s.stop - s.start] for s in prof.stacks],
        "blocks": prof.num_blocks,
        "chain_breaks": sum(1 for b in prof.blocks[1:] if not b.follows_previous),
        "fixed_param_bytes": sum(m.param_bytes for m in prof.fixed_modules),
        "none_peak_bytes": step_peak_bytes(zoo, hf_checkpointing=False),
        "hf_checkpointing_peak_bytes": step_peak_bytes(zoo, hf_checkpointing=True) if zoo.hf_checkpointing else None,
        "least_predicted_bytes": least.prediction.peak_bytes,
        "least_measured_bytes": checks["least"].measured_peak_bytes,
        "least_error_pct": checks["least"].peak_error_pct,
        "half_predicted_bytes": half.prediction.peak_bytes,
        "half_measured_bytes": checks["half-way"].measured_peak_bytes,
        "half_error_pct": checks["half-way"].peak_error_pct,
        "heads": [p.head for p in (least, half)],
        "grads_identical": all(c.grads_identical for c in checks.values()),
        "grads_ok": all(c.ok for c in checks.values()),
        "counts_match": all(c.recompute_counts_match for c in checks.values()),
        "seconds": time.perf_counter() - start,
        "device": prof.environment.device_name,
    }


def markdown(rows: list[dict[str, Any]], repeats: int) -> str:
    lines = [
        "| model | stacks (blocks) | no recomputation | HF checkpointing | remat least feasible (measured) | "
        "vs HF | peak error: least / half-way | gradients, op counts |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        stacks = ", ".join(f"{name} ({count})" for name, count in r["stacks"])
        hf = r["hf_checkpointing_peak_bytes"]
        versus = f"{100 * (r['least_measured_bytes'] / hf - 1):+.1f}%" if hf else "n/a"
        grads = "identical" if r["grads_identical"] else "within the chunked head's tolerance" if r["grads_ok"] else "DIFFER"
        ok = f"{grads}, {'as planned' if r['counts_match'] else 'counts DIFFER'}"
        lines.append(
            f"| {r['model']} | {stacks} | {r['none_peak_bytes'] / MIB:.2f} MiB | "
            f"{f'{hf / MIB:.2f} MiB' if hf else 'n/a'} | {r['least_measured_bytes'] / MIB:.2f} MiB | {versus} | "
            f"{r['least_error_pct']:+.2f}% / {r['half_error_pct']:+.2f}% | {ok} |")
    lines.append("")
    lines.append(
        f"Peaks of a training step with AdamW, measured by remat's live-storage tracker; {repeats} timed step(s) "
        f"per profile; torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} cores" + "".join(f", {d}" for d in sorted({r['device'] for r in rows})) + ".")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(ZOO), choices=list(ZOO))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    rows = []
    for name in args.models:
        rows.append(measure(name, args.repeats))
        print(f"{name}: {rows[-1]['seconds']:.0f} s", file=sys.stderr, flush=True)
    text = markdown(rows, args.repeats)
    print(text)
    if args.json:
        write_atomic(args.json, json.dumps(rows, indent=2) + "\n")
    if args.markdown:
        write_atomic(args.markdown, text + "\n")


if __name__ == "__main__":
    main()
