"""The optimal search on long chains: memory in slots, the table's size, and what rounding costs.

When the byte-exact DP (`remat.plan.chain_exact`) would take too long, the search counts memory
in slots of ``quantum`` bytes (`remat.plan.chain_dp`): every size rounded up and the gradients
down, so a layout the DP accepts fits. The slot count is set by a budget of DP cells that grows
with the chain (`SlotSearch.slot_limit`); `remat.plan.chain_dp.choose_quantum` picks the slot.

What rounding costs, stated two ways:
- a priori: with the replay tables exact and no segment limit, every layout fitting the budget
  less ``(2 N + 3) quantum`` bytes is accepted, so the plan's extra time is no more than any of
  theirs (`rounding_slack_bytes`): each moment of the backward counts at most N + 1 rounded-up
  sizes (one per block and the head's or a block's working set) and N + 1 rounded-down
  gradients, each off by less than a slot, and the allowance loses less than one. With a
  fresh-memory saving (`remat.plan.predict.fresh_memory`) the column is chosen at its highest
  possible peak, so the step may be slower by at most ``first_touch_ms_per_byte`` times that slack;
- a posteriori: `SlotSearch.lower_bound` runs the DP again with sizes rounded down (a
  relaxation: every layout that fits is accepted, at no more than its time) and bounds the moment
  of the head's backward by a Lagrangian knapsack, so no plan fitting the budget is faster than
  that; the plan reports it (`remat.plan.search.Optimality`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from remat.plan.chain_dp import ChainProblem, ChainSolution, choose_quantum, solve_chain
from remat.plan.chain_problem import ChainBuilder
from remat.plan.costs import cost_of
from remat.plan.types import Segment

__all__ = ["SlotSearch", "rounding_slack_bytes", "CELLS_AT_100_BLOCKS", "LONG_CHAIN_BLOCKS", "LONG_CHAIN_SEGMENT",
           "MAX_SLOTS"]

CELLS_AT_100_BLOCKS = 15_000_000
"""DP cell updates allowed for 100 blocks (about 0.15 s); the allowance grows as N^1.5, so 1000
blocks get about 30x the cells. With the DP's cost (about N (K + L) M + L^2 M / 2 cells for
blocks alike in bytes, N L^2 M / 2 otherwise; K options per block, L the longest segment) this
sets M, the memory slots (64 <= M <= MAX_SLOTS)."""
LONG_CHAIN_BLOCKS = 200
"""Chains longer than this search recompute segments of at most LONG_CHAIN_SEGMENT blocks (top
level and nested), so the memory slots can stay fine: a smaller space, not optimal, bounded by
`SlotSearch.lower_bound`."""
LONG_CHAIN_SEGMENT = 16
UNLIKE_CELLS_FACTOR = 8
"""Unlike blocks (the usual case for measured profiles: times differ) get this many times the
cells: their DP is a factor N/9 costlier, and an exact plan is worth a second."""
MAX_SLOTS = 6144


def rounding_slack_bytes(num_blocks: int, quantum: int) -> int:
    """Bytes of budget slot rounding may cost (see the module docstring): a plan for budget B is
    at least as fast as every layout fitting ``B - rounding_slack_bytes``, when the replay tables
    are exact and segments unlimited (`ChainSolution.exact`, ``max_segment_blocks`` None)."""
    return 0 if quantum == 1 else (2 * num_blocks + 3) * quantum


class SlotSearch:
    """Slot-counted DP solutions for one profile's chain (no work in the constructor)."""

    def __init__(self, builder: ChainBuilder, max_slots: int | None = None):
        self.builder = builder
        self.max_slots = max_slots

    def solve(self, allowance: int, to_keep_all: bool = False, limited: bool = True) -> tuple[ChainSolution, int]:
        """Tables up to ``allowance`` bytes; ``to_keep_all``: up to what keeping every block
        needs in rounded slots (>= allowance // quantum), so the no-recomputation end is in the
        table; ``limited``: segments as long as `segment_limit` allows (the frontier: any)."""
        longest = self.segment_limit(allowance) if limited and not to_keep_all else None
        quantum = choose_quantum(self.builder.sizes(), allowance, self.slot_limit(longest))
        problem = self.builder.problem(quantum, (allowance - self.builder.fixed.grad_bytes) // quantum)
        problem = dataclasses.replace(problem, max_segment_blocks=longest)
        if to_keep_all:
            problem = dataclasses.replace(problem, max_segment_blocks=None,
                                          capacity_slots=max(problem.capacity_slots, _keep_all_slots(problem)))
        return solve_chain(problem), quantum

    def best_solution(self, allowance: int) -> tuple[ChainSolution, int]:
        """Tables for ``allowance``; when segments were limited and nothing fits, unlimited."""
        solution, quantum = self.solve(allowance)
        capacity = solution.problem.capacity_slots
        if solution.problem.max_segment_blocks is not None and not math.isfinite(solution.cost(capacity)):
            return self.solve(allowance, limited=False)
        return solution, quantum

    def segment_limit(self, allowance: int) -> int | None:
        """LONG_CHAIN_SEGMENT for chains over LONG_CHAIN_BLOCKS blocks whose exact slot (the gcd
        of the sizes) would not fit the unlimited DP's slot count; else None (any length)."""
        if self.builder.profile.num_blocks <= LONG_CHAIN_BLOCKS:
            return None
        exact = 0
        for size in self.builder.sizes():
            exact = math.gcd(exact, int(size))
        return None if allowance // max(exact, 1) <= self.slot_limit(None) else LONG_CHAIN_SEGMENT

    def slot_limit(self, longest: int | None) -> int:
        if self.max_slots is not None:
            return self.max_slots
        n = self.builder.profile.num_blocks
        longest = longest or n
        alike = self.builder.alike_in_bytes()
        options = sum(len(o) for o in self.builder.options()) / max(n, 1)
        work = n * (options + longest) + longest**2 / 2 + (0 if alike else n * longest**2 / 2)
        cells = CELLS_AT_100_BLOCKS * (n / 100) ** 1.5 * (1 if alike else UNLIKE_CELLS_FACTOR)
        return int(max(64, min(MAX_SLOTS, cells / max(work, 1.0))))

    def lower_bound(self, allowance: int, solution: ChainSolution, quantum: int, saving, tight: bool) -> float:
        """No layout fitting ``allowance`` has a smaller extra time less its fault saving
        (``saving(peak)``: the most a layout peaking at ``peak`` saves, falling with the peak):
        the knapsack bound less the most any layout saves; ``tight``: also the relaxed DP (when
        segments were unlimited), read at every column up to the capacity, each less the most a
        layout accepted there saves (it peaks at or above ``m`` quanta). The relaxed DP costs as
        much as the plan's own."""
        bound = self._knapsack_bound(allowance) - float(saving(0))
        capacity = solution.problem.capacity_slots
        if tight and solution.problem.max_segment_blocks is None:  # the relaxed DP spans the whole space
            relaxed = solve_chain(self.builder.problem(quantum, capacity, relax=True))
            columns = np.array([(m, cost) for m, cost in relaxed.curve() if m <= capacity]).reshape(-1, 2)
            peaks = self.builder.fixed.peak_bytes(columns[:, 0].astype(np.int64) * quantum)
            bound = max(bound, float((columns[:, 1] - saving(peaks)).min(initial=math.inf)))
        return bound

    def _knapsack_bound(self, allowance: int) -> float:
        """Lower bound on the extra ms of every layout fitting ``allowance``, in bytes: what the
        layout holds when the head's backward runs must fit (the other moments are dropped), a
        block in a recompute segment is relaxed to holding nothing and costing its forward once,
        and the resulting multiple-choice knapsack is bounded by its Lagrangian dual
        ``max_lam sum_i min_o (ms_io + lam held_io) - lam room`` (every ``lam >= 0`` bounds it)."""
        fixed = self.builder.fixed
        room = allowance - fixed.grad_bytes - self.builder.head_need(1)
        held, ms = self._relaxed_choices()
        if held.min(axis=1).sum() > room:  # not even the relaxation fits
            return math.inf
        best, lam = 0.0, 1e-12
        for _ in range(120):  # geometric scan of lam from 1e-12 to about 5e3 ms per byte
            best = max(best, float((ms + lam * held).min(axis=1).sum() - lam * room))
            lam *= 1.35
        return best

    def _relaxed_choices(self) -> tuple[np.ndarray, np.ndarray]:
        """Per block (rows), gradient-adjusted held bytes and extra ms of each top-level option
        and of the relaxed recompute choice (padded with inf ms)."""
        profile, rows = self.builder.profile, []
        for i, options in enumerate(self.builder.options()):
            grad = profile.blocks[i].grad_bytes
            replay = cost_of(profile, i, Segment(start=i, stop=i + 1, strategy="recompute"))
            held = (options.retained_bytes - grad).tolist() + [-grad]
            # in a long segment a block pays no checkpointed call of its own: a lower bound
            relaxed = replay.extra_ms - profile.checkpoint_call_ms
            if profile.blocks[i].unavailable_reason("recompute") is not None:
                relaxed = math.inf
            rows.append(list(zip(held, options.extra_ms.tolist() + [relaxed])))
        width = max(len(r) for r in rows)
        held = np.zeros((len(rows), width))
        ms = np.full((len(rows), width), np.inf)
        for i, r in enumerate(rows):
            held[i, : len(r)], ms[i, : len(r)] = zip(*r)
        return held, ms


def _keep_all_slots(problem: ChainProblem) -> int:
    """Gradient-adjusted slots keeping every block needs (option 0 is keep)."""
    held, need = 0, problem.post_slots
    for block in problem.blocks:
        keep = block.options[0]
        need = max(need, held + keep.working_slots - block.grad_slots)
        held += keep.retained_slots - block.grad_slots
    return max(need, held + problem.post_slots)
