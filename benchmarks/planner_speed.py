"""How long `remat.plan(..., strategy="optimal")` takes on long chains of transformer blocks.

Profiles are synthetic but shaped like a measured GPT block (batch 8, sequence 1024, width
1024, 16 heads, fp32): 24 op calls with their output / saved bytes and times, so the knapsack
frontier, the named selective policies, recompute and nesting are all in the search. "alike":
every block identical; "unlike": every op's time jittered by up to 5 % per block, as in a
measured profile (bytes stay equal, so the DP shares its replay tables; every block's options
are priced on their own). The budget is half of the no-recomputation peak. Each row also gives
`OptimalSearch.optimality`: a lower bound on the extra time of any plan that fits the budget,
so "optimum >= x %" bounds how far the plan can be from the best. Chains of up to 48 blocks are
solved exactly in bytes while their time-memory curve stays small (slot "bytes"); longer ones in
slots.

    .venv/bin/python -m benchmarks.planner_speed            # table on stdout
    .venv/bin/python -m benchmarks.planner_speed --markdown planner-speed.md
    .venv/bin/python -m benchmarks.planner_speed --smoke --measured 64,128,256   # pareto, measured MLPs
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time
from pathlib import Path

from remat.measure.types import BlockProfile, Environment, Fingerprint, OpRecord, Profile
from remat._files import write_atomic
from remat.plan.planners import pareto, plan
from remat.plan.search import OptimalSearch, clear_planning_caches

MIB = 2**20
B, S, D, H = 8, 1024, 1024, 16
ACT = B * S * D * 4  # one fp32 activation of the residual stream: 32 MiB
SCORES = B * H * S * S * 4  # one fp32 attention score matrix: 512 MiB

# (op, output bytes, saved bytes, ms, GFLOPs) of one pre-LN transformer block, in call order
_OPS = (
    ("aten.native_layer_norm.default", ACT, ACT, 1.0, 0),
    ("aten.addmm.default", 3 * ACT, ACT, 12.0, 2 * B * S * D * 3 * D),
    ("aten.view.default", 0, 0, 0.0, 0),
    ("aten.transpose.int", 0, 0, 0.0, 0),
    ("aten.bmm.default", SCORES, 2 * ACT, 8.0, 2 * B * S * S * D),
    ("aten.div.Tensor", SCORES, 0, 3.0, 0),
    ("aten.masked_fill.Scalar", SCORES, 0, 3.0, 0),
    ("aten._softmax.default", SCORES, SCORES, 6.0, 0),
    ("aten.native_dropout.default", SCORES + SCORES // 4, SCORES + SCORES // 4, 6.0, 0),
    ("aten.bmm.default", ACT, SCORES, 8.0, 2 * B * S * S * D),
    ("aten.view.default", 0, 0, 0.0, 0),
    ("aten.addmm.default", ACT, ACT, 4.0, 2 * B * S * D * D),
    ("aten.native_dropout.default", ACT + ACT // 4, ACT // 4, 1.0, 0),
    ("aten.add.Tensor", ACT, 0, 0.5, 0),
    ("aten.native_layer_norm.default", ACT, ACT, 1.0, 0),
    ("aten.addmm.default", 4 * ACT, 4 * ACT, 16.0, 2 * B * S * D * 4 * D),
    ("aten.gelu.default", 4 * ACT, 4 * ACT, 4.0, 0),
    ("aten.addmm.default", ACT, 0, 16.0, 2 * B * S * 4 * D * D),
    ("aten.native_dropout.default", ACT + ACT // 4, ACT // 4, 1.0, 0),
    ("aten.add.Tensor", ACT, 0, 0.5, 0),
)


def transformer_block(index: int, rng: random.Random | None = None, jitter: float = 0.0) -> BlockProfile:
    """One block; with ``rng``, every op's time scaled by its own factor in [1, 1 + jitter)."""
    counts: dict[str, int] = {}
    ops = []
    for name, out_bytes, saved, ms, flops in _OPS:
        k = counts.get(name, 0)
        counts[name] = k + 1
        scale = 1 + jitter * rng.random() if rng is not None else 1.0
        ops.append(OpRecord(key=f"{name}#{k}", name=name, output_bytes=out_bytes, saved_bytes=saved,
                            time_ms=ms * scale, flops=flops, is_random="dropout" in name,
                            is_view=out_bytes == 0))
    return BlockProfile(
        index=index, name=f"layers.{index}", class_name="Block", input_bytes=ACT, output_bytes=ACT,
        saved_bytes=sum(o.saved_bytes for o in ops), bwd_temp_bytes=4 * ACT,
        fwd_ms=sum(o.time_ms for o in ops), bwd_ms=2 * sum(o.time_ms for o in ops),
        fwd_flops=sum(o.flops for o in ops), ops=tuple(ops),
    )


def chain_profile(num_blocks: int, jitter: float, seed: int = 0) -> Profile:
    rng = random.Random(seed)
    blocks = tuple(transformer_block(i, rng if jitter else None, jitter) for i in range(num_blocks))
    params = 12 * D * D * 4 * num_blocks
    return Profile(
        fingerprint=Fingerprint(model_hash="bench", batch_shapes=(f"{B}x{S}:int64",), device="cuda",
                                dtype="float32", torch_version="bench"),
        environment=Environment(device_name="synthetic", num_threads=1, python_version=platform.python_version(),
                                hostname="bench"),
        blocks=blocks, param_bytes=params, grad_bytes=params, optimizer_state_bytes=2 * params,
        optimizer_name="AdamW", optimizer_step_temp_bytes=0, optimizer_step_ms=5.0, buffer_bytes=0,
        fixed_pre_saved_bytes=ACT, fixed_post_saved_bytes=8 * ACT, fixed_post_bwd_temp_bytes=8 * ACT,
        fixed_fwd_ms=10.0, fixed_bwd_ms=20.0, fixed_flops=0, step_ms=0.0, peak_bytes=0,
        peak_bytes_by_category={}, device_max_allocated_bytes=None,
    )


def timed(fn, repeats: int) -> tuple[float, float, object]:
    """Median wall seconds and median CPU seconds of ``repeats`` calls, and the last result,
    each call from cold (the planner's caches cleared). CPU seconds (this process) stay
    meaningful when other jobs share the cores."""
    walls, cpus, result = [], [], None
    for _ in range(repeats):
        clear_planning_caches()
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return sorted(walls)[len(walls) // 2], sorted(cpus)[len(cpus) // 2], result


def run(cases: list[tuple[int, str]], repeats: int) -> list[dict]:
    rows = []
    for num_blocks, kind in cases:
        prof = chain_profile(num_blocks, jitter=0.05 if kind == "unlike" else 0.0)
        baseline = plan(prof, strategy="none").prediction
        budget = baseline.peak_bytes // 2
        seconds, cpu_seconds, result = timed(lambda: plan(prof, budget=budget), repeats if num_blocks <= 100 else 1)
        _, options_cpu, _ = timed(lambda: OptimalSearch(prof).options(), 1)
        bound = OptimalSearch(prof).optimality(budget)
        full = plan(prof, strategy="full").prediction
        rows.append(dict(
            blocks=num_blocks, kind=kind, seconds=seconds, cpu_seconds=cpu_seconds, options_cpu=options_cpu,
            budget_mib=budget / MIB, peak_mib=result.prediction.peak_bytes / MIB,
            overhead_pct=100 * (result.prediction.step_ms / baseline.step_ms - 1),
            bound_pct=100 * bound.lower_bound_ms / baseline.step_ms, slot_mib=bound.quantum_bytes / MIB,
            full_peak_mib=full.peak_bytes / MIB, full_overhead_pct=100 * (full.step_ms / baseline.step_ms - 1),
        ))
    return rows


def markdown(rows: list[dict], pareto_row: tuple[int, float, int]) -> str:
    lines = [
        "| blocks | blocks alike? | optimal: wall s | optimal: CPU s | of which pricing options | slot MiB "
        "| budget MiB | planned peak MiB | planned overhead | optimum's overhead >= | full recompute: peak MiB, overhead |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['blocks']} | {r['kind']} | {r['seconds']:.2f} | {r['cpu_seconds']:.2f} | {r['options_cpu']:.2f} | "
            f"{_slot(r['slot_mib'])} | {r['budget_mib']:.0f} | {r['peak_mib']:.0f} | {r['overhead_pct']:+.2f}% | "
            f"{r['bound_pct']:+.2f}% | {r['full_peak_mib']:.0f}, {r['full_overhead_pct']:+.1f}% |"
        )
    n, seconds, points = pareto_row
    lines.append(f"\n`remat.pareto` on {n} alike blocks: {points} frontier plans in {seconds:.2f} s.")
    return "\n".join(lines)


def _slot(slot_mib: float) -> str:
    return "bytes" if slot_mib * MIB == 1 else f"{slot_mib:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", type=Path, help="Also write the table as Markdown here.")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="Only the chains of 10 and 24 blocks.")
    parser.add_argument("--measured", default="", metavar="DEPTHS",
                        help="Also time remat.pareto on measured profiles of the built-in MLP at these depths "
                             "(comma-separated, e.g. 64,128,256; width 128, batch 128, AdamW).")
    args = parser.parse_args()
    cases = [(10, "alike"), (24, "unlike"), (100, "alike"), (100, "unlike"), (1000, "alike"), (1000, "unlike")]
    rows = run(cases[:2] if args.smoke else cases, args.repeats)
    prof = chain_profile(24, 0.0)
    seconds, _, frontier = timed(lambda: pareto(prof), 1)
    text = markdown(rows, (24, seconds, len(frontier)))
    if args.measured:
        text += "\n\n" + measured_pareto([int(d) for d in args.measured.split(",")])
    print(text)
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.markdown, _header() + text + "\n\n" + NOTES)


def measured_pareto(depths: list[int]) -> str:
    """`remat.pareto` on the built-in MLP profiled at each depth (a measured profile: every
    block's own bytes and times), from cold: CPU seconds, frontier plans, least peak."""
    import torch

    from remat.measure.profile import profile
    from remat.models import build

    torch.set_num_threads(1)
    lines = ["| MLP blocks (measured) | pareto: CPU s | frontier plans | least peak MiB |", "| ---: | ---: | ---: | ---: |"]
    for depth in depths:
        built = build("mlp", depth=depth, width=128, batch_size=128)
        prof = profile(built.model, built.batch, built.loss_fn, torch.optim.AdamW(built.model.parameters()))
        _, cpu_seconds, frontier = timed(lambda: pareto(prof), 1)
        lines.append(f"| {depth} | {cpu_seconds:.2f} | {len(frontier)} | {frontier[-1].prediction.peak_bytes / MIB:.2f} |")
    return "\n".join(lines)


NOTES = """Reading the table:
- CPU seconds are this process's own; wall seconds include waiting for the 2 shared cores (the
  load average above), so CPU seconds are what a quiet 2-core machine would show as wall time.
  Targets: 100 blocks < 0.2 s, 1000 blocks < 5 s.
- "of which pricing options": keep / selective options of every block (named policies and the
  knapsack frontier points). Blocks alike in structure (equal op tables but for times, as a
  transformer's layers are) share the work: one knapsack frontier union and one vectorized
  pricing (`remat.plan.costs.selective_prices`) with each block's own op times; each block then
  keeps its own non-dominated options.
- Slot "bytes": the DP counted memory exactly (`remat.plan.chain_exact`: each table entry a
  step function of the free bytes, one solve for every budget): the plan is the optimum of the
  model, the bound equals it. Chains over 48 blocks, or whose curves outgrow the DP's point
  budget, count memory in slots of the size shown; sizes round up to it, so a plan always fits,
  and the search checks the no-recomputation and least-peak layouts by `predict` so that rounding
  never refuses a budget they meet. Blocks alike in bytes share one replay table per length
  (O(N^2 M), or O(N L M) with segments of at most L blocks); forward times that differ are priced
  at the region's least time, a lower bound. Chains over 200 blocks search recompute segments of
  at most 16 blocks (nested ones too), which lets 1000 blocks use 6144 slots instead of about 300.
- "optimum's overhead >=": `OptimalSearch.optimality`'s lower bound on any plan fitting the
  budget (on slots: the DP again with sizes rounded down, and a Lagrangian knapsack bound on the
  moment the head's backward runs; the plan itself carries the knapsack bound alone, which costs
  no second DP: `Plan.optimality`). Planned overhead minus this bound is how far the plan can be
  from the optimum of the byte model. Tests: every layout of measured 3- to 6-block models,
  random toy chains, Revolve's t(l, s) for l = 100 and 1000, the slot rounding bound.
"""


def _header() -> str:
    return (
        "## Planner speed (`benchmarks/planner_speed.py`)\n\n"
        f"`optimal` on synthetic transformer chains, budget = half the no-recomputation peak; "
        f"machine: {platform.processor() or platform.machine()}, 2 cores shared with other jobs (load average "
        f"{os.getloadavg()[0]:.1f} at the end of the run), Python {platform.python_version()}. "
        "Command: `.venv/bin/python -m benchmarks.planner_speed --markdown planner-speed.md`.\n\n"
    )


if __name__ == "__main__":
    main()
