"""The optimal planner's search: the fastest layout of a profile's chain under a byte budget.

`OptimalSearch` builds the chain problem (`remat.plan.chain_problem`: options from the cost
registry, the fixed part in one place) and solves it one of two ways:
- exactly in bytes (`remat.plan.chain_exact`) whenever that is affordable: chains of at most
  EXACT_MAX_BLOCKS blocks whose step functions stay under `remat.plan.chain_exact.MAX_POINTS`
  breakpoints (the built-in models at every benchmark size but the 64-block MLP, in 0.1 s or
  less; a 24-block transformer with 85 options a block in about 0.3 s). One solve serves every
  budget. The plan is the optimum of the byte and time model of
  `remat.plan.predict` at any budget at or above the least feasible peak: no layout of the space
  (keep / selective / offload per block, recompute segments nested to any depth) that fits is
  predicted faster. `Optimality.quantum_bytes` is 1. Terms that depend on other blocks'
  strategies (a mask no checkpoint holds, a kept forward after a kept block) are priced exactly by
  solving one problem per combination of them (`remat.plan.variants`, at most 2^4): every point
  of the curve (`exact_curve`) is the peak and time `predict` gives its layout.
- in slots (`remat.plan.slots`) otherwise: the plan fits, its distance from the optimum is bounded
  and reported (`Optimality`), and the layouts rounding could lose at the ends are checked with
  `predict` too (keeping every block, the least-peak layout): every budget at or above the least
  feasible peak gets a plan, and a budget that keeping everything fits gets no recomputation.
  The terms `remat.plan.variants` prices exactly stay bounds here (counted as if held).

Of the points of the time-memory curve up to the budget the search takes the one whose extra time
less the fresh memory its lower peak no longer faults in (`remat.plan.predict.fresh_memory`) is
least. Offloaded bytes earn no such saving, which the curve does not record: when offload options
and a saving both exist, the choice may miss the optimum, and `Optimality` says by how much at
most.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

from remat.measure.types import Profile
from remat.plan.chain_dp import least_requirement
from remat.plan.chain_exact import ExactSolution, solve_exact
from remat.plan.chain_problem import ChainBuilder, fixed_part, keep_segments
from remat.plan.costs import clear_cost_cache
from remat.plan.options import block_options, structure_classes
from remat.plan.phases import code_held_input_bytes
from remat.plan.policies import clear_subset_cache, knapsack_frontier
from remat.plan.predict import (baseline_step_ms, keep_peak_bytes, pre_backward_phase_bytes, pre_forward_phase_bytes,
                                predict)
from remat.plan.variants import resaved_profile, revived_profile, variants
from remat.plan.slots import SlotSearch
from remat.plan.types import Optimality, Segment

__all__ = ["OptimalSearch", "Choice", "Optimality", "plan_floor", "block_options", "structure_classes",
           "clear_planning_caches", "EXACT_MAX_BLOCKS"]

MAX_CANDIDATES = 32
"""Points of the time-memory curve `OptimalSearch` checks with `predict` for one budget."""
EXACT_MAX_BLOCKS = 48
"""Longest chain the byte-exact DP is tried on: its replay tables' work grows as N^3 (about
0.4 s for 48 blocks)."""


def clear_planning_caches() -> None:
    """Forget what planning caches between calls (selective costs by block, knapsack group
    subsets by op structure): benchmarks time planning from cold."""
    clear_cost_cache()
    clear_subset_cache()


def plan_floor(profile: Profile) -> tuple[int, str]:
    """Least peak any plan can have, ignoring blocks' own bytes, and what sets it."""
    fixed = fixed_part(profile)
    head = fixed.base_bytes + fixed.head_bytes
    if fixed.optimizer_bytes >= head:
        if pre_forward_phase_bytes(profile) == fixed.optimizer_bytes:
            return fixed.optimizer_bytes, "the forward before the first block (model state plus its own peak)"
        if pre_backward_phase_bytes(profile) == fixed.optimizer_bytes:
            return fixed.optimizer_bytes, ("the backward of the part before the first block (model state, "
                                           "gradients, its saved bytes and its own peak)")
        return fixed.optimizer_bytes, "the optimizer step (model state plus step temporaries)"
    return head, "the head's backward (model state, gradients, fixed part saved bytes and temporaries)"


@dataclass(kw_only=True, frozen=True)
class Choice:
    """The search's answer for one budget."""

    segments: tuple[Segment, ...]
    """The plan's top-level segments."""
    optimality: Optimality
    """How far it may be from the fastest plan that fits."""


class OptimalSearch:
    """Options, tables and choices for one profile (no work in the constructor).

    ``joins``: per pair of neighbouring blocks, False where the two may not be in one
    multi-block recompute segment (`remat.plan.chain_dp.ChainProblem.joins`); None: any may.
    ``max_slots``: count memory in at most this many slots (never bytes): tests of the bounds.
    ``priced_like``: the search of the same profile priced with another head strategy
    (`remat.plan.head.priced_profile`), whose blocks' options this one takes instead of pricing
    them again, where they price the same (`remat.plan.chain_problem.ChainBuilder.share_pricing`)."""

    def __init__(self, profile: Profile, max_slots: int | None = None, joins: tuple[bool, ...] | None = None,
                 priced_like: OptimalSearch | None = None):
        self.profile = profile
        self.max_slots = max_slots
        # freed shared tensors, shared tensors a later block saves: bounds
        self.builder = ChainBuilder(resaved_profile(revived_profile(profile)), joins)
        if priced_like is not None:
            self.builder.share_pricing(priced_like.builder)
        self.slots = SlotSearch(self.builder, max_slots)
        self._exact: ExactSolution | None | bool = False  # False: not tried yet
        self._least: tuple[Segment, ...] | None = None
        self._variants: list[tuple[ChainBuilder, ExactSolution]] | None = None
        self._relaxed: ExactSolution | None | bool = False  # False: not tried yet

    def options(self):
        """Per block, its non-dominated top-level options (`remat.plan.options.BlockOptions`)."""
        return self.builder.options()

    # -- one budget -------------------------------------------------------------------------
    def best_segments(self, budget_bytes: int) -> tuple[Segment, ...] | None:
        """Fastest segments with predicted peak <= budget; None when nothing fits."""
        choice = self.choose(budget_bytes)
        return None if choice is None else choice.segments

    def choose(self, budget_bytes: int, tight: bool = False) -> Choice | None:
        """The plan for ``budget_bytes`` and its optimality; None when nothing fits. Counted in
        slots, the bound is the cheap one unless ``tight`` (`remat.plan.slots.SlotSearch.lower_bound`)."""
        if budget_bytes < self.builder.fixed.base_bytes:
            return None
        found = self._exact_choice(budget_bytes) if self.exact_solution() is not None else self._slot_choice(budget_bytes, tight)
        if found is not None:
            return found
        # the least-peak layout, where the curve's layouts near the budget all came out over it under
        # `predict` (a term the tables bound differently): a budget the least peak meets is met
        least = self.min_peak_segments()
        prediction = predict(self.profile, least)
        if prediction.peak_bytes > budget_bytes:
            return None
        extra = prediction.step_ms - baseline_step_ms(self.profile)
        return _choice(least, extra, lower_bound_ms=0.0, quantum=1)

    def optimality(self, budget_bytes: int) -> Optimality:
        """The tightest bound the search has for ``budget_bytes`` (a ValueError when nothing fits)."""
        choice = self.choose(budget_bytes, tight=True)
        if choice is None:
            raise ValueError(
                f"no plan fits the budget of {budget_bytes} bytes; pass a budget that `best_segments` meets.")
        return choice.optimality

    def exact_solution(self) -> ExactSolution | None:
        """The byte-exact tables, solved once for every budget; None for chains over
        EXACT_MAX_BLOCKS, breakpoints past `remat.plan.chain_exact.MAX_POINTS`, or ``max_slots``."""
        if self._exact is False:
            n = self.profile.num_blocks
            eligible = self.max_slots is None and 0 < n <= EXACT_MAX_BLOCKS
            self._exact = solve_exact(self.builder.problem(1, 0)) if eligible else None
        return self._exact  # type: ignore[return-value]

    def exact_variants(self) -> list[tuple[ChainBuilder, ExactSolution]]:
        """The byte-exact tables of the profile and of its variants with shared tensors no
        checkpoint holds and kept neighbours (`remat.plan.variants`), each with its builder; empty where
        `exact_solution` is None."""
        if self._variants is None:
            base = self.exact_solution()
            self._variants = [] if base is None else [(self.builder, base)]
            for variant in variants(self.profile)[1:] if base is not None else ():
                builder = ChainBuilder(variant, self.builder.joins)
                solution = solve_exact(builder.problem(1, 0))
                if solution is not None:
                    self._variants.append((builder, solution))
        return self._variants

    def exact_curve(self) -> list[tuple[int, float, int]]:
        """``(need, least extra ms, variant)`` at every breakpoint of the least time over the
        variants (`exact_variants`), by rising need: the time-memory curve `predict` prices."""
        points = sorted((need, cost, v) for v, (_, solution) in enumerate(self.exact_variants())
                        for need, cost in solution.curve())
        out: list[tuple[int, float, int]] = []
        for need, cost, v in points:
            if not out or cost < out[-1][1]:
                out.append((need, cost, v))
        return out

    def exact_segments(self, need: int, variant: int) -> tuple[Segment, ...]:
        """The layout at a point ``(need, _, variant)`` of `exact_curve`."""
        builder, solution = self.exact_variants()[variant]
        return builder.segments(solution.layout(need))

    def _exact_choice(self, budget_bytes: int) -> Choice | None:
        fixed = self.builder.fixed
        curve = self.exact_curve()
        needs, costs, variants = (np.array(column) for column in zip(*curve))
        allowance = budget_bytes - fixed.base_bytes - fixed.grad_bytes
        bounds = costs - self._saving(fixed.peak_bytes(needs))
        fits = needs <= allowance
        # where no point fits, the least-peak layout still may: the DP bounds some terms from above
        # (a selective block's forward beside the outputs the block before holds, as if not kept)
        best = self._points(budget_bytes, needs, variants, bounds, fits, ends=() if fits.any() else [self.min_peak_segments()])
        slack = self.held_slack()
        if slack:  # the DP counts kept outputs through the backward too: points a little over may fit
            best = self._points(budget_bytes, needs, variants, bounds, (needs > allowance) & (needs <= allowance + slack),
                                ends=[self.min_peak_segments()], first=best)
        relaxed = self.relaxed_solution() if slack else None
        r_bounds = np.zeros(0)
        if relaxed is not None:  # layouts the bounds priced over the budget, or out of the curve
            points = np.array(relaxed.curve(), dtype=float).reshape(-1, 2)
            fit = points[:, 0] <= allowance
            r_needs = points[fit, 0].astype(np.int64)
            r_bounds = points[fit, 1] - self._saving(fixed.peak_bytes(r_needs))
            best = self._fastest(budget_bytes, r_bounds,
                                 lambda k: self.builder.segments(relaxed.layout(int(r_needs[k]))), first=best)
        if best is None:
            return None
        # two lower bounds: the curve's within the slack, and the relaxed tables' (needs bounded below)
        lower = max(float(bounds[needs <= allowance + slack].min(initial=best[1])), float(r_bounds.min(initial=-math.inf)))
        return _choice(*best, lower_bound_ms=lower, quantum=1)

    def relaxed_solution(self) -> ExactSolution | None:
        """The byte-exact tables of the relaxed problem (`remat.plan.chain_problem.ChainBuilder.problem`
        with ``relax``: without the outputs and inputs the code holds beside the checkpoints, which
        the exact tables count through the backward, a bound `held_slack` measures), solved once;
        None where `exact_solution` is. A layout those bounds price above another of less time
        leaves the exact curve, however little the prediction puts it at: the Gated model of
        `tests/plan/test_cached_escaping.py` (its first layer's output held by the code to the end)
        had a least peak 16,384 bytes (2 %) below the one the search found, and refused the
        budgets in between. Its points are candidates too, each priced by `predict`."""
        if self._relaxed is False:
            self._relaxed = None
            if self.exact_solution() is not None:
                self._relaxed = solve_exact(self.builder.problem(1, 0, relax=True))
        return self._relaxed  # type: ignore[return-value]

    def _points(self, budget_bytes: int, needs: np.ndarray, variants: np.ndarray, bounds: np.ndarray,
                mask: np.ndarray, ends=(), first=None) -> tuple[tuple[Segment, ...], float] | None:
        needs, variants = needs[mask], variants[mask]
        return self._fastest(budget_bytes, bounds[mask], lambda k: self.exact_segments(int(needs[k]), int(variants[k])),
                             ends, first)

    def held_slack(self) -> int:
        """The most the DP's need of a layout exceeds its predicted peak's by what the code holds
        beside the checkpoints: the outputs it keeps through later forwards
        (`remat.plan.chain_dp.ChainProblem.later_slots`, counted through the backward) and the
        inputs of checkpoints it holds too (`BlockProfile.code_held_inputs`, counted twice in a
        forward; `Profile.post_code_held`, twice in the post part's need, which the DP takes
        whole), what kept blocks saved that no backward holds (`BlockProfile.saved_dead_bytes`,
        counted through the backwards after them), and the inputs the code holds past their blocks
        (`BlockProfile.input_code_held_bytes`, ``input_code_kept_bytes``: the DP counts a
        segment's all through its replay and the backward after it,
        `remat.plan.predict.code_held_through` those of the blocks replayed by then, and
        `remat.plan.predict.kept_inputs_bytes` those the forward alone keeps in the forwards,
        `remat.plan.predict.saved_after_bytes` those code after the blocks saves): 0 without them."""
        blocks = self.profile.blocks
        later = sum(b.output_later_held_bytes for b in blocks if b.output_held_until >= b.index + 2)
        post = self.profile.post_code_held_saving_bytes if self.profile.head is None else 0
        gone = sum(b.saved_dead_bytes for b in blocks)  # kept, counted through the backwards after it
        code = sum(map(code_held_input_bytes, blocks))
        return (later + max((sum(nbytes for _, nbytes in b.code_held_inputs) for b in blocks), default=0) + post + gone
                + code)

    def _slot_choice(self, budget_bytes: int, tight: bool) -> Choice | None:
        allowance = budget_bytes - self.builder.fixed.base_bytes
        solution, quantum = self.slots.best_solution(allowance)
        capacity = solution.problem.capacity_slots
        columns = np.array([(m, cost) for m, cost in solution.curve() if m <= capacity and math.isfinite(cost)])
        ms, costs = columns.reshape(-1, 2).T
        bounds = costs - self._saving(self.builder.fixed.peak_bytes(ms.astype(np.int64) * quantum))
        # rounding may lose the two ends: keeping every block (no extra time, nothing saved), and
        # (when no column fits) the least peak
        keep_fits = self.builder.fixed.peak_bytes(self.builder.keep_need()) <= budget_bytes
        first = (keep_segments(self.profile.num_blocks), 0.0) if keep_fits else None
        ends = [] if ms.size else [self.min_peak_segments()]
        best = self._fastest(budget_bytes, bounds, lambda k: self.builder.segments(solution.layout(int(ms[k]))), ends,
                             first)
        if best is None:
            return None
        bound = self.slots.lower_bound(allowance, solution, quantum, self._saving, tight)
        return _choice(*best, lower_bound_ms=bound, quantum=quantum)

    def _fastest(self, budget_bytes: int, bounds: np.ndarray, layout_of, ends=(),
                 first=None) -> tuple[tuple[Segment, ...], float] | None:
        """The fastest fitting layout by `predict` among ``first`` (a layout known to fit and its
        step time less the baseline's), ``ends`` and the curve's points, and that time. The
        points are taken by rising lower bound (``bounds``: extra ms less the most their peak
        saves; of equal ones the most memory first) until the next cannot be faster: one point
        unless offloaded bytes save less than the bound assumed (at most MAX_CANDIDATES)."""
        baseline = baseline_step_ms(self.profile)
        best, best_ms = first if first is not None else (None, math.inf)
        order = np.lexsort((-np.arange(bounds.size), bounds))[:MAX_CANDIDATES]
        for candidate in [*ends, *order.tolist()]:
            if not isinstance(candidate, tuple):
                if bounds[candidate] >= best_ms - 1e-9:
                    break
                candidate = layout_of(candidate)
            prediction = predict(self.profile, candidate)
            if prediction.peak_bytes <= budget_bytes and prediction.step_ms - baseline < best_ms:
                best, best_ms = candidate, prediction.step_ms - baseline
        return None if best is None else (best, best_ms)

    def _saving(self, peak_bytes: np.ndarray | int) -> np.ndarray:
        """Ms a plan peaking at ``peak_bytes`` saves in fresh memory against the baseline
        (`remat.plan.predict.fresh_memory` without offloaded bytes: the most it can save)."""
        prof = self.profile
        if not prof.step_fault_bytes or not prof.first_touch_ms_per_byte:
            return np.zeros(np.shape(peak_bytes))
        avoided = np.clip(keep_peak_bytes(prof) - np.asarray(peak_bytes), 0, prof.step_fault_bytes)
        return avoided * prof.first_touch_ms_per_byte

    # -- every budget -----------------------------------------------------------------------
    def min_peak_segments(self) -> tuple[Segment, ...]:
        """Segments with the least predicted peak over the whole plan space (exact, in bytes)."""
        if self._least is None:
            builders = [b for b, _ in self.exact_variants()] or [self.builder]
            least = [least_requirement(b.problem(1, 0)) for b in builders]
            k = min(range(len(least)), key=lambda i: (least[i][0], i))
            self._least = builders[k].segments(least[k][1])
            if self.held_slack() and self.exact_solution() is not None:  # where the bounds hide a lower one
                relaxed = self.builder.segments(least_requirement(self.builder.problem(1, 0, relax=True))[1])
                if predict(self.profile, relaxed).peak_bytes < predict(self.profile, self._least).peak_bytes:
                    self._least = relaxed
        return self._least

    def frontier_segments(self) -> list[tuple[Segment, ...]]:
        """One least-time layout per step of the time-memory curve (every breakpoint when the
        DP is exact in bytes; per slot column otherwise)."""
        if self.exact_solution() is not None:
            return [self.exact_segments(m, v) for m, _, v in self.exact_curve()]
        solution, _ = self.slots.solve(self._keep_all_allowance(), to_keep_all=True)
        out, last = [], math.inf
        for m, cost in solution.curve():
            if cost < last:
                out.append(self.builder.segments(solution.layout(m)))
                last = cost
        return out

    def _keep_all_allowance(self) -> int:
        pred = predict(self.profile, keep_segments(self.profile.num_blocks))
        return max(1, sum(pred.retained_bytes) + self.builder.fixed.head_bytes,
                   pred.peak_bytes - self.builder.fixed.base_bytes)

    def uniform_knapsack_segments(self, budget_bytes: int | None) -> tuple[Segment, ...]:
        """Knapsack on every block with the largest common byte target whose plan fits (the
        least target, 0, when none does). Each block's frontier is built once; the targets (every
        frontier's byte levels) are tried from the largest down, one `predict` each, until one fits."""
        if budget_bytes is None:
            raise ValueError("selective:knapsack needs a budget to size each block's saved ops; pass budget=... or --budget.")
        frontiers = [knapsack_frontier(b) for b in self.profile.blocks]
        targets = sorted({w for frontier in frontiers for w, _, _ in frontier})
        for target in reversed(targets):
            segments = _knapsack_segments(self.profile, frontiers, target)
            if predict(self.profile, segments).peak_bytes <= budget_bytes:
                return segments
        return _knapsack_segments(self.profile, frontiers, targets[0])


def _knapsack_segments(profile: Profile, frontiers: list[list[tuple[int, float, tuple[str, ...]]]],
                       target: int) -> tuple[Segment, ...]:
    """Each block's `knapsack` choice at ``target``: the last point of its frontier within it
    (a frontier's times rise with its bytes)."""
    out = []
    for block, frontier in zip(profile.blocks, frontiers):
        point = frontier[bisect.bisect_right([w for w, _, _ in frontier], target) - 1]
        out.append(Segment(start=block.index, stop=block.index + 1, strategy="selective:knapsack", saved_ops=point[2]))
    return tuple(out)


def _choice(segments: tuple[Segment, ...], extra_ms: float, lower_bound_ms: float, quantum: int) -> Choice:
    optimality = Optimality(extra_ms=extra_ms, lower_bound_ms=min(extra_ms, lower_bound_ms), quantum_bytes=quantum)
    return Choice(segments=segments, optimality=optimality)
