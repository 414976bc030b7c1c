"""The optimal planner's search: per-block options (`remat.plan.options`), slots, the chain DP.

`OptimalSearch` turns a Profile into a `remat.plan.chain_dp.ChainProblem` and turns DP layouts
back into Segments. Every byte and millisecond comes from the cost registry, so the DP prices
what `predict` prices: keep and recompute through `remat.plan.costs.cost_of`, the other options
as `remat.plan.options` prices them.

It returns the optimum of the byte model when the DP's slot is the gcd of the sizes and the
chain DP is exact (see `remat.plan.chain_dp`: small and toy profiles, Revolve chains). Long
chains of measured blocks trade exactness for speed in three stated ways (sizes rounded up to a
coarser slot, replay tables shared by blocks alike in bytes, segments of at most
LONG_CHAIN_SEGMENT blocks past LONG_CHAIN_BLOCKS blocks); `OptimalSearch.optimality` then gives
a lower bound on the best plan, so the distance is known.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from remat.measure.types import Profile
from remat.plan.chain_dp import (
    BlockOption,
    ChainBlock,
    ChainProblem,
    ChainSolution,
    Element,
    choose_quantum,
    deep_recursion,
    least_requirement,
    solve_chain,
)
from remat.plan.costs import clear_cost_cache, cost_of, replay_working_bytes
from remat.plan.options import (
    BlockOptions,
    OptionClass,
    block_options,
    offload_options,
    price_options,
    structure_classes,
    undominated_rows,
)
from remat.plan.policies import clear_subset_cache, knapsack, knapsack_frontier
from remat.plan.predict import backward_base_bytes, grad_bytes_live, keep_peak_bytes, predict
from remat.plan.types import Segment

__all__ = ["OptimalSearch", "Optimality", "plan_floor", "block_options", "structure_classes", "clear_planning_caches",
           "CELLS_AT_100_BLOCKS"]

CELLS_AT_100_BLOCKS = 15_000_000
"""DP cell updates allowed for 100 blocks (about 0.15 s); the allowance grows as N^1.5, so 1000
blocks get about 30x the cells. With the DP's cost (about N (K + L) M + L^2 M / 2 cells for
blocks alike in bytes, N L^2 M / 2 otherwise; K options per block, L the longest segment) this
sets M, the memory slots (64 <= M <= MAX_SLOTS)."""
LONG_CHAIN_BLOCKS = 200
"""Chains longer than this search recompute segments of at most LONG_CHAIN_SEGMENT blocks (top
level and nested), so the memory slots can stay fine: a smaller space, not optimal, bounded by
`OptimalSearch.optimality`."""
LONG_CHAIN_SEGMENT = 16
UNLIKE_CELLS_FACTOR = 8
"""Unlike blocks (the usual case for measured profiles: times differ) get this many times the
cells: their DP is a factor N/9 costlier, and an exact plan is worth a second."""
MAX_SLOTS = 6144
NEVER_SLOTS = 1 << 40
"""Input and replay working slots of a block that cannot be recomputed: no recompute segment
can then start at it (its input would not fit) nor hold it kept or inside a child (its replay
would not fit), at any depth, while its top-level options stay as they are."""


def clear_planning_caches() -> None:
    """Forget what planning caches between calls (selective costs by block, knapsack group
    subsets by op structure): benchmarks time planning from cold."""
    clear_cost_cache()
    clear_subset_cache()


def plan_floor(profile: Profile) -> tuple[int, str]:
    """Least peak any plan can have, ignoring blocks' own bytes, and what sets it."""
    optimizer = profile.model_state_bytes + profile.optimizer_step_temp_bytes
    head = backward_base_bytes(profile) + profile.fixed_pre_saved_bytes + _head_bytes(profile)
    if optimizer >= head:
        return optimizer, "the optimizer step (model state plus step temporaries)"
    return head, "the head's backward (model state, gradients, fixed part saved bytes and temporaries)"


def _post_bytes(profile: Profile) -> int:
    return profile.fixed_post_saved_bytes + profile.fixed_post_bwd_temp_bytes


def _block_phase_grads(profile: Profile) -> int:
    """Gradients live when the first block's backward would start with no block's own yet:
    ``grad_bytes_live(0) + grad_bytes of block 0`` (the DP's ``G``)."""
    return grad_bytes_live(profile, 0) + (profile.blocks[0].grad_bytes if profile.blocks else 0)


def _head_bytes(profile: Profile) -> int:
    """What the head's backward needs above the blocks' retained bytes and the fixed base."""
    return _post_bytes(profile) + grad_bytes_live(profile, profile.num_blocks)


@dataclass(kw_only=True, frozen=True)
class Optimality:
    """How close the optimal planner's plan is to the least extra time any plan fitting the
    budget has, under the byte model of `remat.plan.predict`."""

    extra_ms: float
    """The plan's extra time over no recomputation (the DP's pricing: `remat.plan.costs`)."""
    lower_bound_ms: float
    """No plan whose predicted peak fits the budget has less extra time: the DP run with every
    size rounded down (gradients up), a relaxation, and its replay tables' time lower bound."""
    quantum_bytes: int
    """The DP's memory slot."""

    @property
    def exact(self) -> bool:
        """The plan is optimal: its extra time equals the lower bound."""
        return self.extra_ms <= self.lower_bound_ms * (1 + 1e-9) + 1e-9

    @property
    def gap_ms(self) -> float:
        return max(0.0, self.extra_ms - self.lower_bound_ms)


class OptimalSearch:
    """Options, slot size and DP solutions for one profile (no work in the constructor)."""

    def __init__(self, profile: Profile, max_slots: int | None = None):
        self.profile = profile
        self.max_slots = max_slots
        self._options: list[BlockOptions] | None = None
        self._classes: list[OptionClass] = []
        self._sizes_cache: list[int] | None = None

    # -- public -----------------------------------------------------------------------------
    def best_segments(self, budget_bytes: int) -> tuple[Segment, ...] | None:
        """Fastest segments with predicted peak <= budget; None when nothing fits."""
        allowance = budget_bytes - self._base_bytes()
        if allowance < 0:
            return None
        solution, quantum = self._best_solution(allowance)
        slots = solution.problem.capacity_slots
        if not math.isfinite(solution.cost(slots)):
            return None
        segments = self._segments(solution.layout(self._fastest_slots(solution, quantum, slots)))
        return segments if predict(self.profile, segments).peak_bytes <= budget_bytes else None

    def _fastest_slots(self, solution: ChainSolution, quantum: int, slots: int) -> int:
        """The free slots, up to ``slots``, whose layout has the least predicted step time: the
        least extra ms when a lower peak saves nothing, else the least extra ms less what the
        lower peak saves in fresh memory (`remat.plan.predict.fresh_memory`), priced at the
        peak the slots allow (a layout's peak is at most that, so its saving at least that)."""
        prof = self.profile
        if not prof.step_fault_bytes or not prof.first_touch_ms_per_byte or slots < solution.frame.lo:
            return slots
        if any(offload_options(prof, i) for i in range(prof.num_blocks)):
            return slots  # offloaded bytes save no faults, and the columns do not say how many
        m = np.arange(solution.frame.lo, slots + 1)
        costs = solution.top[0, np.minimum(m - solution.frame.lo, solution.frame.width - 1)]
        peak = np.maximum(self._base_bytes() + _block_phase_grads(prof) + m * quantum,
                          prof.model_state_bytes + prof.optimizer_step_temp_bytes)
        avoided = np.clip(keep_peak_bytes(prof) - peak, 0, prof.step_fault_bytes)
        total = costs - avoided * prof.first_touch_ms_per_byte
        best = np.flatnonzero(total <= total.min() + 1e-9)
        return int(m[best[-1]])  # of equal times, the most memory: the least extra ms

    def _best_solution(self, allowance: int) -> tuple[ChainSolution, int]:
        """Tables for ``allowance``; when segments were limited and nothing fits, unlimited."""
        solution, quantum = self._solve(allowance)
        if solution.problem.max_segment_blocks is not None and not math.isfinite(solution.cost(solution.problem.capacity_slots)):
            return self._solve(allowance, limited=False)
        return solution, quantum

    def optimality(self, budget_bytes: int) -> Optimality:
        """Bound the plan `best_segments` returns (costs a second DP run): slots round sizes up
        and forward times may be priced by shared tables, so the plan can be slower than the
        least; ``Optimality.exact`` says when it is not."""
        allowance = budget_bytes - self._base_bytes()
        solution, quantum = self._best_solution(allowance) if allowance >= 0 else (None, 1)
        if solution is None or not math.isfinite(solution.cost(solution.problem.capacity_slots)):
            raise ValueError(f"no plan fits the budget of {budget_bytes} bytes; pass a budget that `best_segments` meets.")
        capacity = solution.problem.capacity_slots
        extra = solution.layout_ms(solution.layout(capacity))
        bound = self._knapsack_bound(allowance)
        if solution.problem.max_segment_blocks is None:  # the relaxed DP spans the whole space
            bound = max(bound, solve_chain(self._problem(quantum, capacity, relax=True)).cost(capacity))
        return Optimality(extra_ms=extra, lower_bound_ms=min(extra, bound), quantum_bytes=quantum)

    def _knapsack_bound(self, allowance: int) -> float:
        """Lower bound on the extra ms of every layout fitting ``allowance``, in bytes: what the
        layout holds when the head's backward runs must fit (the other moments are dropped), a
        block in a recompute segment is relaxed to holding nothing and costing its forward once,
        and the resulting multiple-choice knapsack is bounded by its Lagrangian dual
        ``max_lam sum_i min_o (ms_io + lam held_io) - lam room`` (every ``lam >= 0`` bounds it)."""
        block_grads = sum(b.grad_bytes for b in self.profile.blocks)
        head = _head_bytes(self.profile) + block_grads - _block_phase_grads(self.profile)
        room = allowance - _block_phase_grads(self.profile) - head
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
        rows = []
        for i, options in enumerate(self.options()):
            grad = self.profile.blocks[i].grad_bytes
            replay = cost_of(self.profile, i, Segment(start=i, stop=i + 1, strategy="recompute"))
            held = (options.retained_bytes - grad).tolist() + [-grad]
            # in a long segment a block pays no checkpointed call of its own: a lower bound
            relaxed = replay.extra_ms - self.profile.checkpoint_call_ms
            if self.profile.blocks[i].unavailable_reason("recompute") is not None:
                relaxed = math.inf
            rows.append(list(zip(held, options.extra_ms.tolist() + [relaxed])))
        width = max(len(r) for r in rows)
        held = np.zeros((len(rows), width))
        ms = np.full((len(rows), width), np.inf)
        for i, r in enumerate(rows):
            held[i, : len(r)], ms[i, : len(r)] = zip(*r)
        return held, ms

    def min_peak_segments(self) -> tuple[Segment, ...]:
        """Segments with the least predicted peak over the whole plan space (exact, in bytes)."""
        _, layout = least_requirement(self._problem(1, 0))
        return self._segments(layout)

    def frontier_segments(self) -> list[tuple[Segment, ...]]:
        """One optimal layout per step of the DP's cost-vs-slots curve."""
        solution, _ = self._solve(self._keep_all_allowance(), to_keep_all=True)
        out, last = [], math.inf
        for m, cost in solution.curve():
            if cost < last:
                out.append(self._segments(solution.layout(m)))
                last = cost
        return out

    def uniform_knapsack_segments(self, budget_bytes: int | None) -> tuple[Segment, ...]:
        """Knapsack on every block with the largest common byte target whose plan fits."""
        if budget_bytes is None:
            raise ValueError("selective:knapsack needs a budget to size each block's saved ops; pass budget=... or --budget.")
        targets = sorted({w for b in self.profile.blocks for w, _, _ in knapsack_frontier(b)})
        fits = [self._knapsack_segments(t) for t in targets]
        peaks = [predict(self.profile, segs).peak_bytes for segs in fits]
        ok = [i for i, peak in enumerate(peaks) if peak <= budget_bytes]
        return fits[ok[-1]] if ok else fits[0]

    # -- internals --------------------------------------------------------------------------
    def _knapsack_segments(self, target: int) -> tuple[Segment, ...]:
        return tuple(
            Segment(start=b.index, stop=b.index + 1, strategy="selective:knapsack", saved_ops=knapsack(b, target_bytes=target))
            for b in self.profile.blocks
        )

    def _base_bytes(self) -> int:
        return backward_base_bytes(self.profile) + self.profile.fixed_pre_saved_bytes

    def _keep_all_allowance(self) -> int:
        keep = tuple(Segment(start=i, stop=i + 1, strategy="keep") for i in range(self.profile.num_blocks))
        pred = predict(self.profile, keep)
        return max(1, sum(pred.retained_bytes) + _head_bytes(self.profile), _keep_block_peak(self.profile))

    def options(self) -> list[BlockOptions]:
        """Per block, its non-dominated top-level options (`remat.plan.options.price_options`)."""
        if self._options is None:
            self._options, self._classes = price_options(self.profile)
        return self._options

    def _solve(self, allowance: int, to_keep_all: bool = False, limited: bool = True) -> tuple[ChainSolution, int]:
        """Tables up to ``allowance``; ``to_keep_all``: up to what keeping every block needs in
        rounded slots (>= allowance // quantum), so the no-recomputation end is in the table;
        ``limited``: segments as long as `_segment_limit` allows (the frontier: any length)."""
        longest = self._segment_limit(allowance) if limited and not to_keep_all else None
        quantum = choose_quantum(self._sizes(), allowance, self._slot_limit(longest))
        problem = self._problem(quantum, (allowance - _block_phase_grads(self.profile)) // quantum)
        problem = dataclasses.replace(problem, max_segment_blocks=longest)
        if to_keep_all:
            problem = dataclasses.replace(problem, max_segment_blocks=None,
                                          capacity_slots=max(problem.capacity_slots, _keep_all_slots(problem)))
        return solve_chain(problem), quantum

    def _segment_limit(self, allowance: int) -> int | None:
        """LONG_CHAIN_SEGMENT for chains over LONG_CHAIN_BLOCKS blocks whose exact slot (the gcd
        of the sizes) would not fit the unlimited DP's slot count; else None (any length)."""
        if self.profile.num_blocks <= LONG_CHAIN_BLOCKS:
            return None
        exact = 0
        for size in self._sizes():
            exact = math.gcd(exact, int(size))
        return None if allowance // max(exact, 1) <= self._slot_limit(None) else LONG_CHAIN_SEGMENT

    def _slot_limit(self, longest: int | None) -> int:
        if self.max_slots is not None:
            return self.max_slots
        n = self.profile.num_blocks
        longest = longest or n
        alike = len({_byte_key(self.profile, i) for i in range(n)}) <= 1
        options = sum(len(o) for o in self.options()) / max(n, 1)
        work = n * (options + longest) + longest**2 / 2 + (0 if alike else n * longest**2 / 2)
        cells = CELLS_AT_100_BLOCKS * (n / 100) ** 1.5 * (1 if alike else UNLIKE_CELLS_FACTOR)
        return int(max(64, min(MAX_SLOTS, cells / max(work, 1.0))))

    def _sizes(self) -> list[int]:
        if self._sizes_cache is None:
            self._sizes_cache = self._all_sizes()
        return self._sizes_cache

    def _all_sizes(self) -> list[int]:
        sizes = [_head_bytes(self.profile), _block_phase_grads(self.profile)]
        for i, block in enumerate(self.profile.blocks):
            keep = cost_of(self.profile, i, Segment(start=i, stop=i + 1, strategy="keep"))
            sizes += [block.input_bytes, keep.retained_bytes, replay_working_bytes(block), block.grad_bytes]
            sizes += self.options()[i].retained_bytes.tolist() + self.options()[i].working_bytes.tolist()
        return sizes

    def _problem(self, quantum: int, capacity: int, relax: bool = False) -> ChainProblem:
        """Slots, gradient-adjusted as in `remat.plan.chain_dp`: the head needs its bytes plus
        the blocks' gradients minus all gradients. Needs round up and gradients down, so a
        layout the DP accepts fits; ``relax``: the other way round, so every layout that fits
        in bytes is accepted (the DP's cost is then a lower bound; held slots are integers, so
        ``(allowance - G) // quantum`` still bounds them)."""
        self.options()
        chain: list[ChainBlock | None] = [None] * self.profile.num_blocks
        for group in self._classes:
            plain = [row for row, i in enumerate(group.members) if not offload_options(self.profile, i)]
            for row, block in zip(plain, self._class_chain_blocks(group, plain, quantum, relax)):
                chain[group.members[row]] = block
        blocks = tuple(b if b is not None else self._chain_block(i, quantum, relax) for i, b in enumerate(chain))
        block_grads = sum(b.grad_bytes for b in self.profile.blocks)
        head = _head_bytes(self.profile) + block_grads - _block_phase_grads(self.profile)
        post = head // quantum if relax else _ceil(head, quantum)
        return ChainProblem(blocks=blocks, post_slots=post, capacity_slots=capacity,
                            segment_ms=self.profile.checkpoint_call_ms)

    def _class_chain_blocks(self, group: OptionClass, rows: list[int], quantum: int, relax: bool) -> list[ChainBlock]:
        """Chain blocks of a structure class's rows (blocks without offload options): the slot
        dominance filter runs on all of them at once; labels index each block's options."""
        retained = _slots(group.retained_bytes, quantum, relax)
        working = _slots(group.working_bytes, quantum, relax)
        ok = group.ok[rows]
        keep = undominated_rows(retained, working, np.where(ok, group.extra_ms[rows], np.inf)) & ok
        position = np.cumsum(ok, axis=1) - 1  # index of a class option in the block's own list
        out = []
        for r, row in enumerate(rows):
            k = np.flatnonzero(keep[r])
            options = tuple(map(BlockOption._make, zip(position[r, k].tolist(), retained[k].tolist(),
                                                       working[k].tolist(), group.extra_ms[row, k].tolist())))
            out.append(self._chain_block(group.members[row], quantum, relax, options))
        return out

    def _chain_block(self, i: int, quantum: int, relax: bool = False,
                     options: tuple[BlockOption, ...] | None = None) -> ChainBlock:
        need, grad = (_floor, _ceil) if relax else (_ceil, _floor)
        keep = cost_of(self.profile, i, Segment(start=i, stop=i + 1, strategy="keep"))
        replay = cost_of(self.profile, i, Segment(start=i, stop=i + 1, strategy="recompute"))
        if options is None:
            opts = self.options()[i]
            retained, working = _slots(opts.retained_bytes, quantum, relax), _slots(opts.working_bytes, quantum, relax)
            ok = undominated_rows(retained, working, opts.extra_ms[None, :])[0]
            options = tuple(BlockOption(label=k, retained_slots=r, working_slots=w, extra_ms=ms) for k, r, w, ms in zip(
                np.flatnonzero(ok).tolist(), retained[ok].tolist(), working[ok].tolist(), opts.extra_ms[ok].tolist()))
        never = self.profile.blocks[i].unavailable_reason("recompute") is not None
        return ChainBlock(
            input_slots=NEVER_SLOTS if never else need(replay.retained_bytes, quantum),
            saved_slots=need(keep.retained_bytes, quantum),
            working_slots=NEVER_SLOTS if never else need(replay_working_bytes(self.profile.blocks[i]), quantum),
            fwd_ms=replay.extra_ms - self.profile.checkpoint_call_ms,  # the segment pays that once
            options=options,
            grad_slots=grad(self.profile.blocks[i].grad_bytes, quantum),
        )

    def _segments(self, elements: tuple[Element, ...]) -> tuple[Segment, ...]:
        with deep_recursion(self.profile.num_blocks):
            return tuple(self._segment(e) for e in elements)

    def _segment(self, element: Element) -> Segment:
        if element.option is not None:
            return self.options()[element.start].option_segment(element.start, element.option)
        children = tuple(self._segment(c) for c in element.children)
        return Segment(start=element.start, stop=element.stop, strategy="recompute", children=children)


def _keep_all_slots(problem: ChainProblem) -> int:
    """Gradient-adjusted slots keeping every block needs (option 0 is keep)."""
    held, need = 0, problem.post_slots
    for block in problem.blocks:
        keep = block.options[0]
        need = max(need, held + keep.working_slots - block.grad_slots)
        held += keep.retained_slots - block.grad_slots
    return max(need, held + problem.post_slots)


def _keep_block_peak(profile: Profile) -> int:
    held, peak = 0, 0
    for i in range(profile.num_blocks):
        cost = cost_of(profile, i, Segment(start=i, stop=i + 1, strategy="keep"))
        peak = max(peak, held + cost.working_bytes + grad_bytes_live(profile, i))
        held += cost.retained_bytes
    return peak


def _byte_key(profile: Profile, i: int) -> tuple:
    """What the DP's replay tables read from block ``i`` besides its forward time (blocks with
    equal keys share O(N^2 M) tables; see `remat.plan.chain_dp.solve_chain`)."""
    b = profile.blocks[i]
    keep = cost_of(profile, i, Segment(start=i, stop=i + 1, strategy="keep"))
    replay = cost_of(profile, i, Segment(start=i, stop=i + 1, strategy="recompute"))
    return (replay.retained_bytes, keep.retained_bytes, replay_working_bytes(b), b.grad_bytes)


def _slots(num_bytes: np.ndarray, quantum: int, relax: bool) -> np.ndarray:
    """Sizes in slots: rounded up (down with ``relax``), as `_ceil` / `_floor`."""
    return num_bytes // quantum if relax else -(-num_bytes // quantum)


def _ceil(num_bytes: int, quantum: int) -> int:
    return -(-int(num_bytes) // quantum)


def _floor(num_bytes: int, quantum: int) -> int:
    return int(num_bytes) // quantum

