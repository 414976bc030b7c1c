"""Build every runner of one benchmark: the peers, then remat's plans at the peers' peaks."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from remat._serialize import to_dict
from remat.apply.head import head_tolerance

from benchmarks._peers.runner import Runner, measure_peak, warm_up
from benchmarks._peers.strategies import EAGER, Peer, PeerUnavailable, compile_module
from benchmarks._peers.workloads import Workload

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Unavailable:
    """A strategy that could not run, and exactly why."""

    name: str
    mode: str
    source: str
    reason: str


@dataclass(kw_only=True)
class Suite:
    """Everything one benchmark run prepared and measured."""

    workload: Workload
    runners: list[Runner] = field(default_factory=list)
    unavailable: list[Unavailable] = field(default_factory=list)
    frontier: list[tuple[int, float]] = field(default_factory=list)
    """remat's predicted Pareto frontier: (peak bytes, step ms) per plan."""
    num_blocks: int = 0
    predicted_baselines: dict[str, float] = field(default_factory=dict)
    """Per profile kind (``compiled``, ``eager``): its predicted step with every block kept."""


def _runner(name: str, mode: str, source: str, workload: Workload, prepare: Any, detail: str = "") -> Runner:
    built = workload.build()
    params = list(built.model.parameters())
    module = prepare(built.model, built.batch)
    return Runner(
        name=name, mode=mode, source=source, module=module, params=params,
        batch=built.batch, loss_fn=built.loss_fn, detail=detail,
    )


def _settle(runner: Runner, warmup_steps: int) -> None:
    warm_up(runner, warmup_steps)
    measure_peak(runner)
    peak_bytes = runner.peak_bytes if runner.peak_bytes is not None else runner.alloc_peak_bytes
    log.info("%s [%s]: peak %.1f MiB", runner.name, runner.mode, (peak_bytes or 0) / 2**20)


def _failure(exc: Exception) -> str:
    if isinstance(exc, PeerUnavailable):
        return str(exc)
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"failed: {type(exc).__name__}: {first_line}"


def try_add(suite: Suite, name: str, mode: str, source: str, prepare: Any, detail: str,
             warmup_steps: int) -> Runner | None:
    """Prepare, warm up and measure one strategy; a strategy that raises is recorded with its error."""
    try:
        runner = _runner(name, mode, source, suite.workload, prepare, detail)
        _settle(runner, warmup_steps)
    except Exception as exc:  # any failure is a result to report, not a reason to stop the run
        log.warning("%s [%s] did not run: %s", name, mode, _failure(exc), exc_info=not isinstance(exc, PeerUnavailable))
        suite.unavailable.append(Unavailable(name=name, mode=mode, source=source, reason=_failure(exc)))
        return None
    suite.runners.append(runner)
    return runner


def add_peers(suite: Suite, peers: list[Peer], warmup_steps: int) -> None:
    """Prepare, warm up and measure the peak of each peer; record the ones that cannot run."""
    for peer in peers:
        try_add(suite, peer.name, peer.mode, "peer", peer.prepare, peer.describe(), warmup_steps)


def _plan_key(plan: Any) -> str:
    """Plans that differ only in how the head runs are different runs."""
    return json.dumps([to_dict(plan.segments), plan.head], sort_keys=True)


def plan_summary(plan: Any) -> str:
    """``keep x3, recompute x2 ...``: how many blocks get each strategy (and the head's, when
    it is not kept whole)."""
    counts: dict[str, int] = {}
    for strategy in plan.block_strategies():
        counts[strategy] = counts.get(strategy, 0) + 1
    pred = plan.prediction
    head = "" if plan.head == "keep" else f", head {plan.head}"
    return (", ".join(f"{s} x{n}" for s, n in counts.items()) + head
            + f"; predicted {pred.peak_bytes / 2**20:.1f} MiB, {pred.step_ms:.0f} ms")


def remat_profile(workload: Workload, blocks: str | None = None) -> Any:
    """remat's profile of a fresh copy of the model (no optimizer, like the benchmark step);
    ``blocks``: `remat.profile`'s (None: the detected stacks)."""
    import remat

    built = workload.build()
    return remat.profile(built.model, built.batch, loss_fn=built.loss_fn, optimizer=None, blocks=blocks)


def matched_plans(profile: Any, budgets: dict[str, int]) -> dict[str, Any]:
    """remat's optimal plan at each peer's measured peak; peers with no feasible plan are left out."""
    import remat

    plans = {}
    for peer_name, budget_bytes in budgets.items():
        try:
            plans[peer_name] = remat.plan(profile, budget=budget_bytes, strategy="optimal")
        except ValueError as exc:
            log.info("no remat plan fits %s's peak (%d bytes): %s", peer_name, budget_bytes, exc)
    return plans


def _remat_prepare(plan: Any, mode: str) -> Any:
    def prepare(model: Any, batch: Any) -> Any:
        import remat

        remat.apply_(model, plan)
        return model if mode == EAGER else compile_module(model)

    return prepare


def add_remat(suite: Suite, profile: Any, plans: list[tuple[str, Any]], mode: str, warmup_steps: int) -> None:
    """One runner per distinct plan, in the given execution mode."""
    seen: set[str] = set()
    for label, plan in plans:
        key = _plan_key(plan)
        if key in seen:
            continue
        seen.add(key)
        prepare = _remat_prepare(plan, mode)
        runner = try_add(suite, f"remat {label}", mode, "remat", prepare, plan_summary(plan), warmup_steps)
        if runner is not None:
            runner.plan = plan
            if mode == EAGER and plan.head != "keep":  # asked of the model as built: an applied head's
                # forward no longer shows the labels argument (Hugging Face's), which would read as no tolerance
                built = suite.workload.build()
                runner.relative_tolerance = head_tolerance(built.model, plan.head, built.batch).relative_tolerance
