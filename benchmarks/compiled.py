"""remat's compiled plans against torch.compile's activation memory budget, side by side.

    python -m benchmarks.compiled [--model gpt] [--size small] [--budgets 0.1 0.3 0.5 0.7]
                                  [--repeats N] [--warmup N] [--threads N] [--dropout P]
                                  [--eager-profile] [--out DIR]

Everything runs compiled with inductor, in one process, timed in interleaved rounds (medians):
plain ``torch.compile`` (the time and gradient reference of the mode), ``torch.compile`` under
each ``activation_memory_budget`` (`torch._functorch.config`), and remat's optimal plan at each
of those runs' measured peaks, planned from a compiled profile (`remat.profile(...,
compiled=True)`), applied, then compiled whole with ``fullgraph=True``. Peaks are the
allocator's (resident bytes + the profiler's allocation events; the live tracker cannot see
inductor's buffers), on every run alike. Gradients of each run are compared with the eager run
without recomputation (``none``).

A plan's budget is the peer's measured peak, and again that peak less the gap between plain
compile's measured peak and the profile's predicted peak without recomputation (the compiled
step around the blocks is not what the eager accounting sees): both plans run, and a remat run
counts against a peer only when its own measured peak is no larger than the peer's.
``--eager-profile`` adds the plans an eager profile makes at the same budgets (compiled alike),
to show what pricing replays as the compiler runs them changes.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from benchmarks._peers import results
from benchmarks._peers.runner import interleaved_timing
from benchmarks._peers.strategies import COMPILED, CompileBudget, NoRecompute, budget_backend
from benchmarks._peers.suite import Suite, add_peers, matched_plans, plan_summary, _plan_key, try_add
from benchmarks._peers.workloads import MODEL_CHOICES, SIZE_NAMES, Workload
from benchmarks.peers import machine

log = logging.getLogger("benchmarks.compiled")

GOAL_RATIO = 1.00
"""remat's time at a peak no larger than a compile budget's, against that budget's time."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compiled", description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=MODEL_CHOICES, default="gpt")
    parser.add_argument("--size", choices=SIZE_NAMES, default="small")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7],
                        help="activation_memory_budget values of the compile peers (default 0.1 0.3 0.5 0.7)")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per run (default 7)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per run (default 2)")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    parser.add_argument("--dropout", type=float, default=None, help="the built-in GPT's dropout (default: its own)")
    parser.add_argument("--eager-profile", action="store_true",
                        help="also run the plans an eager profile makes at the same budgets")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/compiled"))
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 1:
        parser.error(f"--repeats {args.repeats} and --warmup {args.warmup} must both be >= 1.")
    bad = [b for b in args.budgets if not 0.0 < b < 1.0]
    if bad:
        parser.error(f"--budgets {bad} must lie in (0, 1): 1.0 is plain compile, which always runs.")
    return args


def _workload(args: argparse.Namespace) -> Workload:
    overrides = {} if args.dropout is None else {"dropout": args.dropout}
    return Workload(model=args.model, size=args.size, overrides=overrides)


def _remat_prepare(plan: Any) -> Any:
    def prepare(model: torch.nn.Module, batch: Any) -> Any:
        import remat

        remat.apply_(model, plan)
        return torch.compile(model, fullgraph=True, backend=budget_backend(1.0))

    return prepare


def _budgets(suite: Suite, profile: Any) -> dict[str, int]:
    """Per compile peer: its measured peak, and that peak less the calibration gap (module docstring)."""
    import remat

    peers = {r.name: r.alloc_peak_bytes for r in suite.runners if r.source == "peer" and r.mode == COMPILED}
    plain = peers.pop("compile", None)
    keep = remat.predict(profile, [remat.Segment(start=0, stop=profile.num_blocks, strategy="keep")]).peak_bytes
    gap = 0 if plain is None else plain - keep
    budgets = dict(peers)
    if gap:
        budgets.update({f"{name} (calibrated)": peak - gap for name, peak in peers.items()})
    log.info("plain compile peak %.2f MiB, predicted keep-all %.2f MiB", (plain or 0) / 2**20, keep / 2**20)
    return budgets


def run(args: argparse.Namespace) -> tuple[Suite, dict[str, Any]]:
    """Measure every run; returns the suite and the profiles' facts for the report."""
    import remat

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 512
    suite = Suite(workload=_workload(args))
    peers = [NoRecompute(name="none"), CompileBudget(name="compile", budget=1.0)]
    peers += [CompileBudget(name=f"compile budget {b}", budget=b) for b in args.budgets]
    add_peers(suite, peers, args.warmup)
    profiles = {"compiled": _profile(suite.workload, compiled=True)}
    if args.eager_profile:
        profiles["eager"] = _profile(suite.workload, compiled=False)
    suite.num_blocks = profiles["compiled"].num_blocks
    seen: set[str] = set()
    for kind, profile in profiles.items():
        budgets = _budgets(suite, profile)
        for peer, plan in matched_plans(profile, budgets).items():
            key = kind + _plan_key(plan)
            if key in seen:
                continue
            seen.add(key)
            label = f"remat ({kind} profile) @ {peer}"
            runner = try_add(suite, label, COMPILED, "remat", _remat_prepare(plan), plan_summary(plan), args.warmup)
            if runner is not None:
                runner.plan = plan
    interleaved_timing(suite.runners, args.repeats)
    suite.predicted_baselines = {kind: remat.predict(p, [remat.Segment(start=0, stop=p.num_blocks, strategy="keep")]).step_ms
                                 for kind, p in profiles.items()}
    return suite, {kind: p.compiled_backend or "eager" for kind, p in profiles.items()}


def _profile(workload: Workload, *, compiled: bool) -> Any:
    import remat

    built = workload.build()
    return remat.profile(built.model, built.batch, loss_fn=built.loss_fn, optimizer=None, compiled=compiled)


def command_line(args: argparse.Namespace) -> str:
    flags = f"--model {args.model} --size {args.size} --budgets {' '.join(map(str, args.budgets))}"
    flags += f" --repeats {args.repeats} --warmup {args.warmup}"
    flags += f" --threads {args.threads}" if args.threads else ""
    flags += f" --dropout {args.dropout}" if args.dropout is not None else ""
    flags += " --eager-profile" if args.eager_profile else ""
    return f"python -m benchmarks.compiled {flags}"


def match_table(ms: list[results.Match]) -> str:
    """Markdown: the fastest remat run within each compile budget's measured peak."""
    lines = [
        "| compile peer | peer peak MiB | peer ms | remat run | remat peak MiB | remat ms | remat / peer "
        f"| goal (<= {GOAL_RATIO:.2f}) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in ms:
        goal = "no remat run fits" if m.remat is None else ("met" if m.ratio <= GOAL_RATIO else "missed")
        lines.append("| " + " | ".join([
            m.peer, f"{m.peer_peak_bytes / results.MIB:.2f}", f"{m.peer_ms:.1f}", m.remat or "-",
            "-" if m.remat_peak_bytes is None else f"{m.remat_peak_bytes / results.MIB:.2f}",
            "-" if m.remat_ms is None else f"{m.remat_ms:.1f}", "-" if m.ratio is None else f"{m.ratio:.2f}", goal,
        ]) + " |")
    return "\n".join(lines)


def time_model_table(runners: list[Any], baseline_ms: float, predicted_baseline_ms: float) -> tuple[str, list[dict]]:
    """Markdown and JSON: each remat run's predicted step against its measured one, both as a
    ratio to the step without a plan (plain compile measured in the same rounds; the profile's
    prediction with every block kept), so a machine that got slower since profiling cancels out."""
    lines = ["| remat run | predicted ms | measured ms | predicted / no plan | measured / plain compile "
             "| step error (side by side) |", "|---|---|---|---|---|---|"]
    rows = []
    for r in runners:
        predicted = r.plan.prediction.step_ms / predicted_baseline_ms
        measured = r.step_ms / baseline_ms
        error = 100.0 * (measured / predicted - 1.0)
        rows.append({"run": r.name, "predicted_ms": r.plan.prediction.step_ms, "measured_ms": r.step_ms,
                     "predicted_ratio": predicted, "measured_ratio": measured, "error_pct": error})
        lines.append(f"| {r.name} | {r.plan.prediction.step_ms:.1f} | {r.step_ms:.1f} | {predicted:.3f} "
                     f"| {measured:.3f} | {error:+.1f}% |")
    return "\n".join(lines), rows


def _remat_only(rows: list[results.Row], source_kind: str) -> list[results.Match]:
    """The matches recomputed over the remat runs planned from one kind of profile."""
    keep = [r for r in rows if r.source == "peer" or f"({source_kind} profile)" in r.name]
    return [m for m in results.matches(keep) if m.mode == COMPILED]


def report(args: argparse.Namespace, suite: Suite, kinds: dict[str, str], elapsed_s: float) -> tuple[str, dict]:
    all_rows = results.rows(suite)
    sizes = ", ".join(f"{k}={v}" for k, v in suite.workload.sizes.items())
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        f"### {suite.workload.label}: {suite.num_blocks} blocks ({sizes})",
        f"`{command_line(args)}` on {stamp}; {machine()}; run took {elapsed_s:.0f} s.",
        results.strategy_table(all_rows),
    ]
    payload: dict[str, Any] = {"command": command_line(args), "machine": machine(), "elapsed_s": elapsed_s,
                               "rows": [r.__dict__ for r in all_rows], "matches": {}}
    for kind in kinds:
        ms = _remat_only(all_rows, kind)
        parts += [f"remat planned from the {kind} profile, against each compile budget at a peak no larger "
                  "than the budget's (allocator peaks, one run):", match_table(ms)]
        payload["matches"][kind] = [{**m.__dict__, "ratio": m.ratio} for m in ms]
    plain = next((r for r in suite.runners if r.name == "compile" and r.step_ms), None)
    payload["time_model"] = {}
    for kind in kinds:
        runners = [r for r in suite.runners if r.plan is not None and f"({kind} profile)" in r.name and r.step_ms]
        if plain is None or not runners:
            continue
        table, rows = time_model_table(runners, plain.step_ms, suite.predicted_baselines[kind])
        parts += [f"Predicted step time of the plans from the {kind} profile (predicted "
                  f"{suite.predicted_baselines[kind]:.1f} ms without a plan; plain compile measured "
                  f"{plain.step_ms:.1f} ms):", table]
        payload["time_model"][kind] = rows
    return "\n\n".join(parts) + "\n", payload


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    started = time.perf_counter()
    suite, kinds = run(args)
    text, payload = report(args, suite, kinds, time.perf_counter() - started)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{args.model.replace(':', '-')}-{args.size}"
    (args.out / f"{stem}.md").write_text(text)
    (args.out / f"{stem}.json").write_text(json.dumps(payload, indent=1, default=str))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
