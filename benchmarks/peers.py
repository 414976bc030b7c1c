"""remat against the alternatives, side by side in one run.

    python -m benchmarks.peers --model gpt [--size tiny|small|large] [--device cpu|cuda]
                               [--repeats N] [--out DIR] [--no-compile] [--parity]

For one model: every peer (no recomputation, per-block checkpointing as Hugging Face applies
it, checkpoint_sequential with sqrt(N) segments, torchtitan's selective policy, torch.compile
with activation memory budgets, Rockmate) and remat's optimal plan at each peer's measured
peak, plus points of remat's Pareto frontier. The timed repeats of all strategies are
interleaved; medians are reported. Writes ``<out>/<model>-<size>.md``, ``.json`` and ``.png``.

``--parity``: instead, each recipe against remat running the same layout as a plan
(`benchmarks._peers.parity`); writes ``<out>/<model>-<size>-parity.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks._peers import plot, results
from benchmarks._peers.runner import interleaved_timing
from benchmarks._peers.strategies import COMPILED, EAGER, Peer, default_peers
from remat._files import write_atomic
from benchmarks._peers.suite import Suite, add_peers, add_remat, matched_plans, remat_profile
from benchmarks._peers.workloads import MODEL_CHOICES, SIZE_NAMES, Workload

log = logging.getLogger("benchmarks.peers")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=MODEL_CHOICES, default="gpt")
    parser.add_argument("--size", choices=SIZE_NAMES, default="small")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per strategy (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per strategy (default 2)")
    parser.add_argument("--frontier-points", type=int, default=4,
                        help="extra plans of remat's Pareto frontier to measure (default 4)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile peers")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch.set_num_threads (default 0: torch's default); 1 helps on an oversubscribed CPU")
    parser.add_argument("--parity", action="store_true",
                        help="each recipe against remat's plan of the same layout, side by side")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 1:
        parser.error(f"--repeats {args.repeats} and --warmup {args.warmup} must both be >= 1.")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda was given but torch.cuda.is_available() is False; use --device cpu.")
    return args


def _configure_dynamo() -> None:
    # Every compiled strategy is a separate cache entry of the same forward code.
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.accumulated_cache_size_limit = 512


def _frontier_plans(profile: object, count: int) -> tuple[list[tuple[int, float]], list[tuple[str, object]]]:
    """remat's predicted frontier, and ``count`` of its plans to measure, spread evenly from the
    fastest to the lowest-peak plan (both ends included)."""
    import remat

    frontier = list(remat.pareto(profile))
    points = [(p.prediction.peak_bytes, p.prediction.step_ms) for p in frontier]
    if count <= 0 or not frontier:
        return points, []
    last = len(frontier) - 1
    indices = sorted({round(i * last / max(1, count - 1)) for i in range(count)}) if count > 1 else [last]
    return points, [(f"frontier @ {frontier[i].prediction.peak_bytes / results.MIB:.1f} MiB", frontier[i])
                    for i in indices]


def run(args: argparse.Namespace) -> Suite:
    """Prepare and measure every strategy of one model; returns the measured suite."""
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    workload = Workload(model=args.model, size=args.size, device=args.device)
    return run_suite(workload, default_peers(with_compile=not args.no_compile), repeats=args.repeats,
                     warmup=args.warmup, frontier_points=args.frontier_points)


def run_suite(workload: Workload, peers: list[Peer], *, repeats: int, warmup: int = 2,
              frontier_points: int = 4) -> Suite:
    """Measure ``peers`` on ``workload``, then remat's optimal plan at each peer's peak (in the
    peer's mode: eager, and compiled when a compiled peer is among them) and ``frontier_points``
    plans of remat's frontier, all timed interleaved; returns the measured suite."""
    _configure_dynamo()
    suite = Suite(workload=workload)
    add_peers(suite, peers, warmup)
    profile = remat_profile(suite.workload)
    suite.num_blocks = profile.num_blocks
    compiled = any(p.mode == COMPILED for p in peers)
    for mode in (EAGER,) + ((COMPILED,) if compiled else ()):
        budgets = {r.name: r.peak_bytes if mode == EAGER else r.alloc_peak_bytes
                   for r in suite.runners if r.source == "peer" and r.mode == mode}
        plans = [(f"@ {name}", plan) for name, plan in matched_plans(profile, budgets).items()]
        if mode == EAGER:
            suite.frontier, extra = _frontier_plans(profile, frontier_points)
            plans += extra
        add_remat(suite, profile, plans, mode, warmup)
    interleaved_timing(suite.runners, repeats)
    return suite


def machine() -> str:
    """One line about where this ran."""
    cpu = platform.processor() or platform.machine()
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    load = ", load average %.2f %.2f %.2f" % __import__("os").getloadavg()
    return f"{platform.node()}: {cpu}, torch {torch.__version__}, {torch.get_num_threads()} threads{gpu}{load}"


def command_line(args: argparse.Namespace) -> str:
    flags = f"--model {args.model} --size {args.size} --device {args.device} --repeats {args.repeats}"
    flags += f" --warmup {args.warmup} --frontier-points {args.frontier_points}"
    flags += f" --threads {args.threads}" if args.threads else ""
    flags += " --no-compile" if args.no_compile else ""
    return f"python -m benchmarks.peers {flags}" + (" --parity" if args.parity else "")


def goal_ratio(workload: Workload) -> float:
    """remat / peer to reach at the peer's peak: 0.85 where blocks differ, 1.00 on uniform chains."""
    return results.HETEROGENEOUS_GOAL if workload.heterogeneous else results.UNIFORM_GOAL


def report(args: argparse.Namespace, suite: Suite, elapsed_s: float) -> str:
    """The Markdown section of one model."""
    all_rows = results.rows(suite)
    sizes = ", ".join(f"{k}={v}" for k, v in suite.workload.sizes.items())
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return "\n\n".join([
        f"### {suite.workload.label}: {suite.num_blocks} blocks ({sizes})",
        f"`{command_line(args)}` on {stamp}; {machine()}; run took {elapsed_s:.0f} s.",
        results.strategy_table(all_rows),
        "remat against each peer at a peak no larger than the peer's:",
        results.match_table(results.matches(all_rows, goal_ratio(suite.workload))),
    ]) + "\n"


def parity_main(args: argparse.Namespace) -> int:
    """``--parity``: every recipe against remat's plan of its layout; writes Markdown and JSON."""
    from benchmarks._peers import parity

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    workload = Workload(model=args.model, size=args.size, device=args.device)
    suite, pairs = parity.run_parity(workload, parity.default_recipes(), repeats=args.repeats, warmup=args.warmup)
    elapsed_s = time.perf_counter() - started
    sizes = ", ".join(f"{k}={v}" for k, v in workload.sizes.items())
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    skipped = "".join(f"\n- {u.name}: did not run ({u.reason})" for u in suite.unavailable)
    text = "\n\n".join([
        f"### {workload.label}: {suite.num_blocks} blocks ({sizes}), same layout",
        f"`{command_line(args)}` on {stamp}; {machine()}; run took {elapsed_s:.0f} s.",
        parity.parity_table(pairs),
    ]) + ("\n\nRecipes that did not run here:" + skipped if skipped else "") + "\n"
    stem = f"{args.model.replace(':', '-')}-{args.size}-parity"
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / f"{stem}.md", text)
    payload = {"command": command_line(args), "machine": machine(), "elapsed_s": elapsed_s,
               "pairs": parity.parity_json(pairs),
               "unavailable": [{"name": u.name, "reason": u.reason} for u in suite.unavailable]}
    write_atomic(args.out / f"{stem}.json", json.dumps(payload, indent=1))
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    if args.parity:
        return parity_main(args)
    started = time.perf_counter()
    suite = run(args)
    elapsed_s = time.perf_counter() - started
    stem = f"{args.model.replace(':', '-')}-{args.size}"
    args.out.mkdir(parents=True, exist_ok=True)
    all_rows = results.rows(suite)
    text = report(args, suite, elapsed_s)
    write_atomic(args.out / f"{stem}.md", text)
    payload = {"command": command_line(args), "machine": machine(), "elapsed_s": elapsed_s,
               **results.as_json(all_rows, results.matches(all_rows, goal_ratio(suite.workload)))}
    write_atomic(args.out / f"{stem}.json", json.dumps(payload, indent=1))
    plot.frontier_png(args.out / f"{stem}.png", suite.workload.label, all_rows, suite.frontier)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
