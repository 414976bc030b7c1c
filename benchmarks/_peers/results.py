"""Rows, matched-peak ratios and the Markdown tables of one benchmark run."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from benchmarks._peers.runner import GradCheck, Runner, compare_grads
from benchmarks._peers.strategies import COMPILED, EAGER
from benchmarks._peers.suite import Suite

MIB = 2**20
UNIFORM_GOAL = 1.00
"""remat / peer at the peer's peak on chains of identical blocks (issue 20)."""
HETEROGENEOUS_GOAL = 0.85
"""remat / peer at the peer's peak where blocks differ in size (issue 20)."""
REFERENCE_NAMES = {EAGER: "none", COMPILED: "compile"}


@dataclass(kw_only=True, frozen=True)
class Row:
    """One strategy's measurements."""

    name: str
    mode: str
    source: str
    detail: str
    peak_bytes: int | None
    """Live tracker (remat.measure.tracker)."""
    alloc_peak_bytes: int | None
    """Resident bytes + allocator peak (torch.profiler memory events)."""
    cuda_peak_bytes: int | None
    step_ms: float | None
    num_timed_steps: int
    overhead_pct: float | None
    """Against the no-recompute run of the same mode."""
    grads_vs_eager: str
    """Loss and gradients against eager no-recompute."""
    grads_vs_mode: str
    """Compiled runs: against compiled no-recompute (empty for eager runs)."""
    identical: bool
    """Bit-identical loss and gradients against the reference of its mode."""
    accepted: bool
    """Bit-identical, or (a plan that chunks the LM head) within the head's stated relative
    tolerance (`GradCheck.accepted`)."""
    unavailable_reason: str = ""

    @property
    def match_peak_bytes(self) -> int | None:
        """The peak compared within a mode: the live tracker in eager mode, the allocator under
        torch.compile (the tracker does not see the buffers of inductor's kernels)."""
        return self.peak_bytes if self.mode == EAGER else self.alloc_peak_bytes


@dataclass(kw_only=True, frozen=True)
class Match:
    """remat against one peer at a peak no larger than the peer's."""

    peer: str
    mode: str
    peer_peak_bytes: int
    peer_ms: float
    best_peer: str
    """Fastest recomputing peer of this mode whose peak is no larger than this peer's."""
    best_peer_ms: float
    remat: str | None
    """Fastest remat run of this mode with a peak no larger than the peer's (eager: with identical
    gradients, or within a chunked head's tolerance)."""
    remat_peak_bytes: int | None
    remat_ms: float | None
    goal_ratio: float = UNIFORM_GOAL
    """The goal: remat's time at most this multiple of the peer's."""
    none_ms: float | None = None
    """The step without recomputation (this mode's reference), measured in the same rounds: no
    plan at or under the peer's peak recomputes less, so none runs meaningfully faster."""

    @property
    def bound(self) -> float | None:
        """``none_ms / peer_ms``: the least ratio any plan could reach (where it is above the
        goal, the goal cannot be met on this workload)."""
        return None if self.none_ms is None else self.none_ms / self.peer_ms

    @property
    def ratio(self) -> float | None:
        return None if self.remat_ms is None else self.remat_ms / self.peer_ms

    @property
    def ratio_vs_best(self) -> float | None:
        return None if self.remat_ms is None else self.remat_ms / self.best_peer_ms

    @property
    def goal_met(self) -> bool:
        return self.ratio is not None and self.ratio <= self.goal_ratio


def _reference(runners: list[Runner], mode: str) -> Runner | None:
    name = REFERENCE_NAMES[mode]
    return next((r for r in runners if r.name == name and r.mode == mode), None)


def _row(runner: Runner, eager_ref: Runner | None, mode_ref: Runner | None) -> Row:
    vs_eager = compare_grads(runner, eager_ref) if eager_ref else None
    vs_mode = compare_grads(runner, mode_ref) if mode_ref and runner.mode != EAGER else None
    same_mode: GradCheck | None = vs_mode if runner.mode != EAGER else vs_eager
    overhead = None
    if mode_ref and mode_ref.step_ms and runner.step_ms:
        overhead = 100.0 * (runner.step_ms / mode_ref.step_ms - 1.0)
    return Row(
        name=runner.name, mode=runner.mode, source=runner.source, detail=runner.detail,
        peak_bytes=runner.peak_bytes, alloc_peak_bytes=runner.alloc_peak_bytes, cuda_peak_bytes=runner.cuda_peak_bytes, step_ms=runner.step_ms,
        num_timed_steps=len(runner.times_ms), overhead_pct=overhead,
        grads_vs_eager=vs_eager.label if vs_eager else "n/a",
        grads_vs_mode=vs_mode.label if vs_mode else "",
        identical=bool(same_mode and same_mode.identical),
        accepted=bool(same_mode and same_mode.accepted),
    )


def rows(suite: Suite) -> list[Row]:
    """A row per runner, then one per strategy that could not run."""
    eager_ref = _reference(suite.runners, EAGER)
    out = [_row(r, eager_ref, _reference(suite.runners, r.mode)) for r in suite.runners]
    for u in suite.unavailable:
        out.append(Row(
            name=u.name, mode=u.mode, source=u.source, detail="", peak_bytes=None, alloc_peak_bytes=None,
            cuda_peak_bytes=None,
            step_ms=None, num_timed_steps=0, overhead_pct=None, grads_vs_eager="n/a", grads_vs_mode="",
            identical=False, accepted=False, unavailable_reason=u.reason,
        ))
    return out


def _measured(rs: list[Row]) -> list[Row]:
    return [r for r in rs if r.match_peak_bytes is not None and r.step_ms is not None]


def matches(all_rows: list[Row], goal_ratio: float = UNIFORM_GOAL) -> list[Match]:
    """For each recomputing peer: the fastest remat run of its mode within its peak, against
    ``goal_ratio`` (`UNIFORM_GOAL` or `HETEROGENEOUS_GOAL`)."""
    measured = _measured(all_rows)
    references = {r.mode: r.step_ms for r in measured if r.source == "peer" and r.name == REFERENCE_NAMES[r.mode]}
    out = []
    for peer in measured:
        if peer.source != "peer" or peer.name == REFERENCE_NAMES[peer.mode]:
            continue
        limit = peer.match_peak_bytes
        same_mode = [r for r in measured if r.mode == peer.mode and r.match_peak_bytes <= limit]
        peers_within = [r for r in same_mode if r.source == "peer" and r.name != REFERENCE_NAMES[r.mode]]
        best = min(peers_within, key=lambda r: r.step_ms)
        # No compiled run is bit-identical to another (inductor draws dropout masks with its own
        # RNG and fuses differently), so identity is required of eager runs only; a plan that
        # chunks the LM head reorders the loss's sums over tokens, and is held to its tolerance.
        remats = [r for r in same_mode if r.source == "remat" and (r.accepted or r.mode != EAGER)]
        fastest = min(remats, key=lambda r: r.step_ms) if remats else None
        out.append(Match(
            peer=peer.name, mode=peer.mode, peer_peak_bytes=limit, peer_ms=peer.step_ms,
            best_peer=best.name, best_peer_ms=best.step_ms,
            remat=fastest.name if fastest else None,
            remat_peak_bytes=fastest.match_peak_bytes if fastest else None,
            remat_ms=fastest.step_ms if fastest else None, goal_ratio=goal_ratio,
            none_ms=references.get(peer.mode),
        ))
    return out


def _fmt(value: float | None, spec: str, empty: str = "-") -> str:
    return empty if value is None else format(value, spec)


def strategy_table(all_rows: list[Row]) -> str:
    """Markdown: strategy, mode, peak MiB, step ms, overhead, gradient check."""
    cuda = any(r.cuda_peak_bytes is not None for r in all_rows)
    head = "| strategy | mode | peak MiB (tracker) | peak MiB (allocator) |" + (" CUDA max alloc MiB |" if cuda else "")
    head += " step ms (median) | overhead vs none | gradients vs eager none | what it does |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in all_rows:
        grads = r.grads_vs_eager + (f"; vs compile: {r.grads_vs_mode}" if r.grads_vs_mode else "")
        if r.unavailable_reason:
            grads, detail = "did not run", r.unavailable_reason
        else:
            detail = r.detail
        cells = [r.name, r.mode, _fmt(r.peak_bytes and r.peak_bytes / MIB, ".2f"),
                 _fmt(r.alloc_peak_bytes and r.alloc_peak_bytes / MIB, ".2f")]
        if cuda:
            cells.append(_fmt(r.cuda_peak_bytes and r.cuda_peak_bytes / MIB, ".2f"))
        cells += [_fmt(r.step_ms, ".1f"), _fmt(r.overhead_pct, "+.1f") + ("%" if r.overhead_pct is not None else ""),
                  grads, detail]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def match_table(ms: list[Match]) -> str:
    """Markdown: remat against each peer at a peak no larger than the peer's."""
    goal = ms[0].goal_ratio if ms else UNIFORM_GOAL
    lines = [
        "| peer | mode | peer peak MiB | peer ms | best peer within that peak | remat run | remat peak MiB "
        f"| remat ms | remat / peer | remat / best peer | none / peer (bound) | goal (remat / peer <= {goal:.2f}) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in ms:
        goal = "met" if m.goal_met else ("no remat run fits" if m.remat is None else "missed")
        if not m.goal_met and m.bound is not None and m.bound > m.goal_ratio:
            goal += " (out of reach: none / peer > goal)"
        lines.append("| " + " | ".join([
            m.peer, m.mode, f"{m.peer_peak_bytes / MIB:.2f}", f"{m.peer_ms:.1f}",
            f"{m.best_peer} ({m.best_peer_ms:.1f} ms)", m.remat or "-",
            _fmt(m.remat_peak_bytes and m.remat_peak_bytes / MIB, ".2f"), _fmt(m.remat_ms, ".1f"),
            _fmt(m.ratio, ".2f"), _fmt(m.ratio_vs_best, ".2f"), _fmt(m.bound, ".2f"), goal,
        ]) + " |")
    return "\n".join(lines)


def as_json(all_rows: list[Row], ms: list[Match]) -> dict:
    """JSON-able results."""
    return {
        "rows": [asdict(r) for r in all_rows],
        "matches": [{**asdict(m), "ratio": m.ratio, "ratio_vs_best": m.ratio_vs_best, "bound": m.bound,
                     "goal_met": m.goal_met}
                    for m in ms],
    }
