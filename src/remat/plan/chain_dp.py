"""Exact dynamic program for the fastest plan of a chain of blocks under a memory allowance.

The plan space (the one `remat.plan.predict` prices):
- top level: a sequence of elements covering blocks 0..N-1; an element is one block with a
  per-block option (keep, selective:<policy> with its saved ops, offload...), or a recompute
  segment ``[a, b)`` that holds the input of ``a``;
- inside a recompute segment, while it is replayed: a sequence of recompute children (holding
  their inputs) and kept blocks, children nesting the same way, to any depth (the Revolve /
  rotor family, Griewank & Walther 2000; Herrmann et al. 2019).

Gradients. Block j's backward starts with the gradients of every block after it (and of the
fixed part) live: ``G - sum_{i<=j} grad_i``. Since the blocks before j are exactly those covered
by the elements held before j, the constraint ``held_j + work_j + G - sum_{i<=j} grad_i <= A``
becomes ``sum_E (retained_E - grad_E) + (work_j - grad_j) <= A - G``: each element holds its
retained bytes *minus its own blocks' gradients* (possibly negative), each block works with
``work - grad``, the allowance is ``A - G`` and the head (no gradients yet) needs
``post + sum grad_i - G``. Nothing depends on a block's position any more, so alike blocks stay
alike.

Memory is counted in slots of ``quantum`` bytes (sizes rounded up, gradients and the allowance
down, so a plan the DP accepts fits). When every size is a multiple of the quantum the DP is
exact for the byte model; `choose_quantum` picks the gcd of the sizes whenever that keeps the
table small. Table columns are ``m`` = free slots, from ``lo`` (below it nothing fits) to ``hi``
(above it keeping everything fits, or ``m`` is unreachable), so ``m`` may be negative.

Tables:
- ``inner[l][r, m]``: least replay time (ms) of the backward of a replay region of ``l`` blocks
  starting at block ``a`` (row ``r`` = ``a``; a single row when all blocks are alike) that
  fits in ``m``. First element: keep block ``a`` (needs ``m >= work_a - grad_a``, leaves
  ``m - saved_a + grad_a``) or a recompute child ``[a, a+j)``, ``j < l`` (cost
  ``fwd[a:a+j] + inner[j][a, m]``, leaves ``m - input_a + grad[a:a+j]`` to the rest). A region
  ends with a kept block, whose replay stops at its last saved tensor
  (`remat.plan.types.Segment.stops_early`): ``inner[1][a]`` needs the block's
  ``stop_working_slots`` and costs ``-stop_saving_ms`` (the region's forwards are counted whole
  where it is replayed).
- ``top[a, m]``: least extra time of the backward of blocks ``a..N-1`` plus the head's backward
  (``top[N, m] = 0`` iff ``m >= post``), first element a per-block option or a recompute
  segment ``[a, a+j)``, ``j <= N - a``.
Only minima are stored; `ChainSolution.layout` finds each choice again from the tables.

When the result is the optimum, and when it is not:
- exact for the slot problem when the replay tables are per region (blocks unlike in slots, or
  alike in slots with ``N^3 M / 6 <= exact_cells``) or the blocks' forward times are equal, and
  ``max_segment_blocks`` is None; exact for the byte model when, besides, every size is a
  multiple of the slot;
- blocks alike in slots whose forward times differ share one table of replayed block forwards
  per length, priced at the region's least forward time: the DP's cost is a lower bound and
  `ChainSolution.gap_ms` bounds the distance of its layout from the least;
- ``max_segment_blocks`` below N searches a smaller space (not optimal);
- a slot larger than the gcd of the sizes rounds them up (the plan fits, and may be slower
  than the best): `remat.plan.search.OptimalSearch.optimality` bounds the loss, and
  `remat.plan.slots` states what rounding may cost. The same recurrences counted in bytes, with
  step functions in place of slot columns, are `remat.plan.chain_exact`.
Time O(N (K + L) M + L^2 M) for blocks alike in slots (K options per block, L the longest
segment, M slots), O(N L^2 M) otherwise.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = [
    "BlockOption", "ChainBlock", "ChainProblem", "ChainSolution", "Element", "SegmentForward", "UnitSlots", "solve_chain",
    "choose_quantum",
    "least_requirement", "deep_recursion", "EXACT_CELLS",
]

_INF = np.inf


class BlockOption(NamedTuple):
    """A top-level per-block choice other than recompute (a named tuple: chains of a thousand
    blocks have tens of thousands of options)."""

    label: int
    """Caller's index for this option."""
    retained_slots: int
    working_slots: int
    extra_ms: float


@dataclass(kw_only=True, frozen=True)
class ChainBlock:
    """One block in slot units."""

    input_slots: int
    """Held by a recompute segment starting here."""
    saved_slots: int
    """Held when kept during a replay."""
    unsaved_slots: int = 0
    """Its input its checkpoint holds and it does not save (an input that needs no gradient, one
    only a frozen weight's matmul reads): held, besides ``saved_slots``, when the block is kept
    first in the replay of a segment starting at it (a region's later blocks take their inputs
    from the replay, and what they do not save is gone after their forward). The slot tables
    here, which do not tell such a region from the rest of a longer one, count it wherever the
    block is kept in a replay (`replay_saved_slots`: a bound); `remat.plan.chain_exact` and
    `least_requirement` count it exactly."""
    working_slots: int
    """Needed by its own backward."""
    fwd_ms: float
    """One replay (less `ChainProblem.segment_ms`, which a segment pays once)."""
    options: tuple[BlockOption, ...]
    """Top-level options (keep first)."""
    grad_slots: int = 0
    """Its parameters' gradients (released from what it holds: see the module docstring)."""
    stop_working_slots: int | None = None
    """Needed by its backward when it is the last block of a replay region, whose replay stops
    at its last saved tensor (`remat.plan.types.Segment.stops_early`; None: ``working_slots``)."""
    stop_saving_ms: float = 0.0
    """What that early stop takes off its replay (the forward after its last saved tensor)."""
    later_working_slots: int | None = None
    """``working_slots`` kept after another block of the same replay, its inputs from the replay
    (`remat.plan.phases.replay_working_bytes` with ``first=False``; None: ``working_slots``).
    The slot tables count ``working_slots`` wherever the block is kept in a replay (a bound)."""
    later_stop_working_slots: int | None = None
    """`last_working_slots` so (None: `last_working_slots`)."""

    @property
    def last_working_slots(self) -> int:
        """``working_slots`` as the last block of a replay region (`stop_working_slots`)."""
        return self.working_slots if self.stop_working_slots is None else self.stop_working_slots

    def kept_slots(self, first: bool) -> tuple[int, int, int]:
        """(held, working, working as the region's last) when kept in a replay: ``first`` in the
        replay of a segment starting at it, else after another block of it."""
        if first:
            return self.saved_slots + self.unsaved_slots, self.working_slots, self.last_working_slots
        work = self.working_slots if self.later_working_slots is None else self.later_working_slots
        last = self.last_working_slots if self.later_stop_working_slots is None else self.later_stop_working_slots
        return self.saved_slots, work, last

    @property
    def replay_saved_slots(self) -> int:
        """``saved_slots`` and ``unsaved_slots``: what the slot tables hold for a kept block."""
        return self.saved_slots + self.unsaved_slots

    @functools.cached_property
    def option_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Retained slots, working slots and extra ms of the options, as arrays."""
        retained, working, extra = zip(*((o.retained_slots, o.working_slots, o.extra_ms) for o in self.options))
        return np.array(retained, dtype=np.int64), np.array(working, dtype=np.int64), np.array(extra, dtype=float)

    def signature(self) -> tuple:
        opts = tuple((o.retained_slots, o.working_slots, o.extra_ms) for o in self.options)
        return (self.input_slots, self.saved_slots, self.unsaved_slots, self.working_slots, self.grad_slots, self.fwd_ms,
                opts, self.last_working_slots, self.stop_saving_ms, self.kept_slots(False))

    def byte_signature(self) -> tuple:
        """What a replay region's tables depend on besides the forward times."""
        return (self.input_slots, self.saved_slots, self.unsaved_slots, self.working_slots, self.grad_slots,
                self.last_working_slots, self.kept_slots(False))


@dataclass(kw_only=True, frozen=True)
class UnitSlots:
    """ZeRO-3/FSDP: what a top-level recompute segment ``[a, b)`` adds to every phase of its
    replay, in slots (`remat.plan.phases.unit_extra_bytes`, rounded up: its blocks are one unit,
    gathered whole)."""

    unit_bytes: tuple[int, ...]
    """Per block, its weights unsharded."""
    quantum: int
    relax: bool = False
    """Round down (the DP's cost a lower bound), not up (a layout it accepts fits)."""

    def slots(self, a: int, stops: np.ndarray) -> np.ndarray:
        """Extra slots of the segments ``[a, b)`` for each ``b`` of ``stops``."""
        prefix = np.concatenate([[0], np.cumsum(self.unit_bytes, dtype=np.int64)])
        stops = np.asarray(stops, dtype=np.int64)
        grown = np.maximum(0, prefix[stops] - prefix[a] - max(self.unit_bytes))
        extra = grown * (1 + (a > 0) + (stops < len(self.unit_bytes)))
        extra[stops - a < 2] = 0
        return extra // self.quantum if self.relax else -(-extra // self.quantum)


@dataclass(kw_only=True, frozen=True)
class SegmentForward:
    """What the forward of a top-level recompute segment ``[a, b)`` needs, in slots,
    gradient-adjusted as every need here (`remat.plan.phases.segment_forward_bytes`: its input,
    the outputs of its blocks held for the model's calls, a block's checkpointed forward; no
    gradient exists yet, so the blocks' before ``a`` are added back and ``G`` taken off)."""

    first_bytes: tuple[int, ...]
    """Per block, what a segment starting there holds: its held input and entry bytes."""
    output_bytes: tuple[int, ...]
    peak_bytes: tuple[int, ...]
    """Per block, its checkpointed forward's peak above its start, its output included."""
    grad_bytes: tuple[int, ...]
    """Per block, the gradients its backward allocates (`remat.plan.phases.released_grad_bytes`)."""
    total_grad_bytes: int
    """``G`` of the problem."""
    quantum: int
    relax: bool = False

    def slots(self, a: int, stops: np.ndarray) -> np.ndarray:
        """Needs of the forwards of the segments ``[a, b)`` for each ``b`` of ``stops``."""
        stops = np.asarray(stops, dtype=np.int64)
        if not stops.size:
            return np.zeros(0, dtype=np.int64)
        outputs = np.concatenate([[0], np.cumsum(self.output_bytes, dtype=np.int64)])
        j = np.arange(a, int(stops.max()))
        running = np.maximum.accumulate(outputs[j] - outputs[a] + np.asarray(self.peak_bytes, dtype=np.int64)[j])
        before = int(sum(self.grad_bytes[:a]))
        need = self.first_bytes[a] + running[stops - 1 - a] + before - self.total_grad_bytes
        return need // self.quantum if self.relax else -(-need // self.quantum)


@dataclass(kw_only=True, frozen=True)
class ChainProblem:
    blocks: tuple[ChainBlock, ...]
    post_slots: int
    """Head backward's need, gradient-adjusted: post saved + temporaries + sum grad_i - G."""
    capacity_slots: int
    """Free slots at the start, gradient-adjusted (allowance - G); may be negative."""
    max_segment_blocks: int | None = None
    """Longest recompute segment (top level or nested) the DP considers; None: any length.
    Below the number of blocks the search space is smaller and the result is not optimal."""
    segment_ms: float = 0.0
    """Paid once per recompute segment, top level or nested (one checkpointed call's own cost:
    `remat.measure.types.Profile.checkpoint_call_ms`), on top of its blocks' ``fwd_ms``."""
    joins: tuple[bool, ...] | None = None
    """Per pair of neighbours (N - 1 entries): False where blocks ``i`` and ``i + 1`` may not
    be in one multi-block recompute segment, top level or nested; None: any may join. Only the
    top level needs the mask: a nested child lies inside its parent, which the mask allowed."""

    replayable: tuple[bool, ...] | None = None
    """Per block: False where it may not be in any recompute segment (its replay failed when
    profiled: `remat.measure.types.BlockProfile.unavailable`); None: every block may."""
    units: UnitSlots | None = None
    """ZeRO-3/FSDP: what a top-level recompute segment of several blocks adds to its replay's
    need (one unit, gathered whole); None: nothing."""

    forward: SegmentForward | None = None
    """What the forward of each top-level recompute segment needs (None: nothing beyond its replay)."""
    later_slots: tuple[int, ...] | None = None
    """Per block, what a top-level recompute segment holding it adds to what the segment holds
    (the outputs the model's code keeps through later blocks' forwards:
    `remat.measure.types.BlockProfile.output_later_held_bytes`; a bound: they are live in those
    forwards only); None: nothing."""

    code_held_slots: tuple[int, ...] | None = None
    """Per block, what a top-level recompute segment that runs it after its first block holds
    from its forward to the step's end, its replay included (the input the model's code holds
    past the block, which the replay makes again:
    `remat.measure.types.BlockProfile.input_code_held_bytes`, ``input_code_kept_bytes``; a bound
    where the code keeps it in the forward alone); None: nothing."""

    def later(self, a: int, stops: np.ndarray) -> np.ndarray:
        """``later_slots`` summed over each segment ``[a, b)`` of ``stops``, and `code_held`."""
        stops = np.asarray(stops, dtype=np.int64)
        if self.later_slots is None:
            return self.code_held(a, stops)
        prefix = np.concatenate([[0], np.cumsum(self.later_slots, dtype=np.int64)])
        return prefix[stops] - prefix[a] + self.code_held(a, stops)

    def code_held(self, a: int, stops: np.ndarray) -> np.ndarray:
        """``code_held_slots`` of blocks ``a + 1 .. b - 1`` for each segment ``[a, b)`` of ``stops``."""
        stops = np.asarray(stops, dtype=np.int64)
        if self.code_held_slots is None:
            return np.zeros(stops.shape, dtype=np.int64)
        prefix = np.concatenate([[0], np.cumsum(self.code_held_slots, dtype=np.int64)])
        return prefix[np.maximum(stops, a + 1)] - prefix[a + 1]

    def forward_slots(self, a: int, stops: np.ndarray) -> np.ndarray:
        """`SegmentForward.slots` (no constraint without ``forward``)."""
        stops = np.asarray(stops, dtype=np.int64)
        return np.full(stops.shape, _NONE, dtype=np.int64) if self.forward is None else self.forward.slots(a, stops)

    def unit_slots(self, a: int, stops: np.ndarray) -> np.ndarray:
        """What the replay of each segment ``[a, b)`` of ``stops`` needs beyond its blocks':
        `UnitSlots.slots` (zeros without ``units``) and `code_held`."""
        stops = np.asarray(stops, dtype=np.int64)
        units = np.zeros(stops.shape, dtype=np.int64) if self.units is None else self.units.slots(a, stops)
        return units + self.code_held(a, stops)

    def __post_init__(self) -> None:
        if self.joins is not None and len(self.joins) != max(len(self.blocks) - 1, 0):
            raise ValueError(
                f"joins has {len(self.joins)} entries for {len(self.blocks)} blocks; give one per pair of "
                f"neighbours ({max(len(self.blocks) - 1, 0)}), or None when any blocks may join."
            )
        if self.replayable is not None and len(self.replayable) != len(self.blocks):
            raise ValueError(f"replayable has {len(self.replayable)} entries for {len(self.blocks)} blocks; give one "
                             "per block, or None when every block may be replayed.")

    def segment_units(self) -> float:
        """`segment_ms` in the shared replay tables' unit (replayed block forwards): at the
        slowest block's forward, so that scaled by a region's least forward it never exceeds
        `segment_ms` (the tables stay a lower bound; exact when the forwards are equal)."""
        slowest = max((b.fwd_ms for b in self.blocks), default=0.0)
        return self.segment_ms / slowest if slowest > 0 else 0.0

    def stop_units(self) -> float:
        """The blocks' `ChainBlock.stop_saving_ms` in the shared replay tables' unit: the largest
        saving over the least forward, so that a region priced at its least forward never exceeds
        its cost (exact when the forwards and savings are equal)."""
        least = min((b.fwd_ms for b in self.blocks), default=0.0)
        most = max((b.stop_saving_ms for b in self.blocks), default=0.0)
        return most / least if least > 0 else 0.0

    def segment_limit(self) -> int:
        n = len(self.blocks)
        return n if self.max_segment_blocks is None else max(1, min(n, self.max_segment_blocks))

    def longest_segment(self, a: int) -> int:
        """Blocks in the longest recompute segment allowed to start at block ``a`` (the limit,
        the joins and the blocks that may be replayed; 0: none)."""
        replayable = self.replayable or (True,) * len(self.blocks)
        joins = self.joins or (True,) * max(len(self.blocks) - 1, 0)
        if not replayable[a]:
            return 0
        length = min(len(self.blocks) - a, self.segment_limit())
        for i in range(a, a + length - 1):
            if not (joins[i] and replayable[i + 1]):
                return i + 1 - a
        return length


@dataclass(kw_only=True, frozen=True)
class Element:
    """A solution element: ``option`` label for a block, or a recompute segment with children."""

    start: int
    stop: int
    option: int | None
    """Label of the per-block option; None for a recompute segment."""
    children: tuple[Element, ...] = ()


@dataclass(kw_only=True, frozen=True)
class _Frame:
    """Column range of the tables and the gradient prefix sums."""

    lo: int
    width: int
    grad_prefix: np.ndarray

    def column(self, m: int) -> int:
        return min(m - self.lo, self.width - 1)

    def grads(self, a: int, b: int) -> int:
        return int(self.grad_prefix[b] - self.grad_prefix[a])


def _frame(problem: ChainProblem) -> _Frame:
    blocks = problem.blocks
    needs = [w - b.grad_slots for b in blocks for w in (b.working_slots, b.last_working_slots)]
    for b in blocks:
        if b.options:
            working = b.option_arrays[1]
            needs += [int(working.min()) - b.grad_slots, int(working.max()) - b.grad_slots]
    lo = min(needs + [problem.post_slots])
    keep_all = sum(max(0, b.replay_saved_slots - b.grad_slots) for b in blocks) + max([0, problem.post_slots] + needs)
    reach = problem.capacity_slots + sum(b.grad_slots for b in blocks)
    hi = max(lo, min(reach, keep_all))
    prefix = np.concatenate([[0], np.cumsum([b.grad_slots for b in blocks])]).astype(np.int64)
    return _Frame(lo=lo, width=hi - lo + 1, grad_prefix=prefix)


class ChainSolution:
    """The filled tables; `cost(m)` and `layout(m)` read them."""

    def __init__(self, problem: ChainProblem, frame: _Frame, top: np.ndarray, inner, inner_choice, alike: bool):
        self.problem, self.frame, self.top = problem, frame, top
        self.inner, self.inner_choice, self.alike = inner, inner_choice, alike
        """``inner_choice`` is None for shared tables: choices are found again along the layout."""
        fwd = [b.fwd_ms for b in problem.blocks]
        self.exact = not alike or len({(b.fwd_ms, b.stop_saving_ms) for b in problem.blocks}) <= 1
        """True: `cost` is the least extra ms of the slot problem as posed (its segment limit
        included). False (shared replay tables
        over blocks whose forward times differ): `cost` is a lower bound and `gap_ms` bounds how
        far the layout may be from the least."""
        self._fwd_prefix = np.concatenate([[0.0], np.cumsum(fwd)])
        self._stop_saving = [b.stop_saving_ms for b in problem.blocks]

    def cost(self, m: int) -> float:
        """Least extra ms with ``m`` free slots (inf: infeasible); a lower bound when not `exact`."""
        return _INF if m < self.frame.lo else float(self.top[0, self.frame.column(m)])

    def layout_ms(self, elements: tuple[Element, ...]) -> float:
        """Extra ms of a layout priced with every block's own forward time."""
        with deep_recursion(len(self.problem.blocks)):
            return sum(self._element_ms(e, top=True) for e in elements)

    def _element_ms(self, element: Element, top: bool) -> float:
        if element.option is not None:
            options = self.problem.blocks[element.start].options
            return next(o.extra_ms for o in options if o.label == element.option) if top else 0.0
        forward = float(self._fwd_prefix[element.stop] - self._fwd_prefix[element.start]) + self.problem.segment_ms
        if not any(c.start <= element.stop - 1 < c.stop for c in element.children):  # it stops early
            forward -= self._stop_saving[element.stop - 1]
        return forward + sum(self._element_ms(c, top=False) for c in element.children)

    def gap_ms(self, m: int) -> float:
        """Upper bound on how much slower the layout for ``m`` free slots is than the least of
        the slot problem (0.0 when `exact`)."""
        if self.exact or not math.isfinite(self.cost(m)):
            return 0.0
        return max(0.0, self.layout_ms(self.layout(m)) - self.cost(m))

    def curve(self) -> list[tuple[int, float]]:
        """``(m, least extra ms)`` for every column of the table."""
        return [(k + self.frame.lo, float(c)) for k, c in enumerate(self.top[0])]

    def layout(self, m: int) -> tuple[Element, ...]:
        """Top-level elements of the optimal plan for ``m`` free slots."""
        with deep_recursion(len(self.problem.blocks)):
            return self._layout(m)

    def _layout(self, m: int) -> tuple[Element, ...]:
        out: list[Element] = []
        a, n = 0, len(self.problem.blocks)
        while a < n:
            code = self._top_code(a, m)
            block = self.problem.blocks[a]
            if code < 0:
                option = block.options[-code - 1]
                out.append(Element(start=a, stop=a + 1, option=option.label))
                a, m = a + 1, m - option.retained_slots + block.grad_slots
            else:
                own = m - int(self.problem.unit_slots(a, [a + code])[0])  # the replay's, its unit gathered
                out.append(Element(start=a, stop=a + code, option=None, children=self._inner_layout(a, code, own)))
                held = block.input_slots + int(self.problem.later(a, np.array([a + code]))[0])
                a, m = a + code, m - held + self.frame.grads(a, a + code)
        return tuple(out)

    def _inner_layout(self, a: int, length: int, m: int) -> tuple[Element, ...]:
        out: list[Element] = []
        while length > 0:
            j = self._inner_pick(a, length, m)
            block = self.problem.blocks[a]
            if j == 0:
                a, length, m = a + 1, length - 1, m - block.replay_saved_slots + block.grad_slots
                continue
            out.append(Element(start=a, stop=a + j, option=None, children=self._inner_layout(a, j, m)))
            a, length, m = a + j, length - j, m - block.input_slots + self.frame.grads(a, a + j)
        return tuple(out)

    def _at(self, rows: np.ndarray, ms: np.ndarray) -> np.ndarray:
        """``rows[i]`` read at ``ms[i]`` free slots (inf below ``lo``), as `_shift` reads them."""
        ms = np.asarray(ms)
        cols = np.minimum(np.maximum(ms - self.frame.lo, 0), self.frame.width - 1)
        return np.where(ms < self.frame.lo, _INF, rows[np.arange(len(rows)), cols])

    def _top_code(self, a: int, m: int) -> int:
        """The `_top` choice at block ``a`` with ``m`` free slots: ``-(option + 1)`` or a
        segment length, recomputed from the filled tables with the same arithmetic."""
        block, gp = self.problem.blocks[a], self.frame.grad_prefix
        opts, m = block.options, min(m, self.frame.lo + self.frame.width - 1)
        retained, working, extra = block.option_arrays
        opt_cost = extra + self._at(np.repeat(self.top[a + 1 : a + 2], len(opts), 0), m - retained + block.grad_slots)
        opt_cost[m < working - block.grad_slots] = _INF
        js = np.arange(1, self.problem.longest_segment(a) + 1)
        rest = self._at(self.top[a + js], m - block.input_slots - self.problem.later(a, a + js) + (gp[a + js] - gp[a]))
        inner = self._segment_inner(a, js, m - self.problem.unit_slots(a, a + js))
        seg_cost = (self._fwd_prefix[a + js] - self._fwd_prefix[a]) + self.problem.segment_ms + inner + rest
        seg_cost[m < self.problem.forward_slots(a, a + js)] = _INF
        k = int(np.argmin(np.concatenate([opt_cost, seg_cost])))
        return -(k + 1) if k < len(opts) else k - len(opts) + 1

    def _segment_inner(self, a: int, js: np.ndarray, ms: np.ndarray) -> np.ndarray:
        """The replay of each segment ``[a, a + j)`` at its ``ms`` free slots."""
        if not self.alike:  # one table per length: read each at its column, in Python (no per-call arrays)
            lo, last = self.frame.lo, self.frame.width - 1
            return np.array([_INF if m < lo else float(self.inner[j][a, min(m - lo, last)])
                             for j, m in zip(js.tolist(), np.broadcast_to(ms, js.shape).tolist())])
        fwd = self._fwd_prefix[a + 1 :] - self._fwd_prefix[a:-1]
        counts = self._at(self.inner.table[js], ms)
        return _scaled(counts[:, None], np.minimum.accumulate(fwd)[: js.size])[:, 0]

    def _inner_pick(self, a: int, length: int, m: int) -> int:
        """First child's length (0: keep block ``a``) of the replay region ``[a, a+length)``."""
        if not self.alike:
            return int(self.inner_choice[length][a, self.frame.column(m)])
        block, table = self.problem.blocks[0], self.inner.table
        m = min(m, self.frame.lo + self.frame.width - 1)
        keep = self._at(table[length - 1 : length], [m - block.replay_saved_slots + block.grad_slots])
        if length == 1:  # nothing after it: fits wherever the block's own need does
            keep[:] = -self.problem.stop_units()
        if m < (block.last_working_slots if length == 1 else block.working_slots) - block.grad_slots:
            keep[:] = _INF
        js = np.arange(1, length)
        rest = self._at(table[length - js], m - block.input_slots + js * block.grad_slots)
        children = rest + self._at(table[js], np.full(js.size, m)) + js + self.problem.segment_units()
        return int(np.argmin(np.concatenate([keep, children])))


@contextlib.contextmanager
def deep_recursion(num_blocks: int):
    """Allow recursion as deep as the nesting of ``num_blocks`` segments (least-memory plans
    of long chains nest one segment per block)."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 8 * num_blocks + 1000))
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


def choose_quantum(sizes_bytes: list[int], allowance_bytes: int, max_slots: int) -> int:
    """Slot size: the gcd of all sizes when the allowance then spans <= ``max_slots`` slots
    (exact); else, among sizes between allowance / ``max_slots`` and twice that (that value, the
    next power of two, multiples of the gcd), the one that wastes the fewest bytes when every
    size is rounded up to it."""
    g = 0
    for size in sizes_bytes:
        g = math.gcd(g, int(size))
    g = max(g, 1)
    if allowance_bytes // g <= max_slots:
        return g
    least = max(1, math.ceil(allowance_bytes / max_slots))
    candidates = {least, 1 << (least - 1).bit_length()}
    candidates |= {k * g for k in (-(-least // g), -(-2 * least // g)) if k * g <= 2 * least}

    sizes = np.array([int(v) for v in sizes_bytes], dtype=np.int64)

    def waste(q: int) -> int:  # bytes added by rounding every size up to a multiple of q
        return int((-(-sizes // q) * q - sizes).sum())

    return min(sorted(candidates), key=waste)


def _shift(rows: np.ndarray, shifts: np.ndarray) -> np.ndarray:
    """``out[r, k] = rows[r, k - shifts[r]]``: inf where ``k - shift < 0``, the last column where
    it passes the end (costs do not rise with free memory; see `_frame` for why it is exact)."""
    width = rows.shape[1]
    if shifts.size and (shifts == shifts[0]).all():
        out = np.empty(rows.shape)
        _shift_into(out, rows, int(shifts[0]))
        return out
    idx = np.arange(width)[None, :] - shifts[:, None]
    out = np.take_along_axis(rows, np.clip(idx, 0, width - 1), axis=1)
    out[idx < 0] = _INF
    return out


def _shift_row(row: np.ndarray, shifts: np.ndarray) -> np.ndarray:
    """``out[r, k] = row[k - shifts[r]]`` with `_shift`'s edges, read from windows of one padded row."""
    width = row.size
    before = int(np.clip(shifts.max(), 0, width))
    after = int(np.clip(-shifts.min(), 0, width))
    padded = np.concatenate([np.full(before, _INF), row, np.full(after, row[-1])])
    windows = np.lib.stride_tricks.sliding_window_view(padded, width)
    return windows[before - np.clip(shifts, -after, before)]


def _below(width: int, lo: int, needs: np.ndarray) -> np.ndarray:
    """Mask of columns whose free slots ``m = k + lo`` are below each row's need."""
    return np.arange(width)[None, :] < (needs - lo)[:, None]


EXACT_CELLS = 3_000_000
"""`solve_chain` fills O(N^3 M) exact replay tables for blocks alike in bytes but not in forward
time while N^3 M / 6 stays under this (about 0.05 s); above it, shared tables and a bound."""


def solve_chain(problem: ChainProblem, exact_cells: int = EXACT_CELLS) -> ChainSolution:
    """Fill the inner and top tables (see the module docstring).

    Replay tables depend on the blocks' slots and forward times. When every block has the same
    slots (`ChainBlock.byte_signature`) one table of replayed block forwards per length serves
    every region: O(N^2 M). Equal forward times make it exact; unequal ones price a region at
    its count times the region's least forward time, a lower bound, and `ChainSolution.gap_ms`
    says how far the layout may be from the least (the exact O(N^3 M) tables are used instead
    while ``N^3 M / 6 <= exact_cells``). Top-level options and segment forwards always use each
    block's own times.
    """
    frame = _frame(problem)
    blocks = problem.blocks
    alike = len({b.byte_signature() for b in blocks}) <= 1
    if alike and len({b.fwd_ms for b in blocks}) > 1 and len(blocks) ** 3 * frame.width / 6 <= exact_cells:
        alike = False
    inner, inner_choice = (_inner_alike if alike else _inner_general)(problem, frame)
    top = _top(problem, frame, inner, alike)
    return ChainSolution(problem, frame, top, inner, inner_choice, alike)


def _keep_first(blocks, rest: np.ndarray, frame: _Frame, rest_empty: bool,
                saving: np.ndarray | float = 0.0) -> np.ndarray:
    """Cost of keeping the first block of each row, then the rest region in what is left
    (``rest_empty``: nothing is left to run, which fits in any memory, even below ``lo``: the
    block is the region's last, its replay stops early and costs ``-saving``)."""
    saved = np.array([b.replay_saved_slots - b.grad_slots for b in blocks])
    if rest_empty:
        need = np.array([b.last_working_slots - b.grad_slots for b in blocks])
        out = np.empty(rest.shape)
        out[:] = -np.reshape(saving, (-1, 1))
    else:
        need = np.array([b.working_slots - b.grad_slots for b in blocks])
        out = _shift(rest, saved)
    out[_below(frame.width, frame.lo, need)] = _INF
    return out


def _inner_alike(problem: ChainProblem, frame: _Frame):
    """Inner tables for blocks alike in slots, in replayed block forwards (not ms): one row per
    length, all first children at once."""
    n, width = problem.segment_limit(), frame.width
    block, units = problem.blocks[0], problem.segment_units()
    table = np.zeros((n + 1, width))
    stacked = np.empty((n, width))
    js = np.arange(1, n)
    for length in range(1, n + 1):
        stacked[0] = _keep_first([block], table[length - 1 : length], frame, length == 1, problem.stop_units())[0]
        children = stacked[1:length]
        if block.grad_slots == 0:
            _shift_into(children, table[length - 1 : 0 : -1], block.input_slots)
        else:
            children[:] = _shift(table[length - 1 : 0 : -1], block.input_slots - js[: length - 1] * block.grad_slots)
        children += table[1:length]
        children += js[: length - 1, None] + units
        np.min(stacked[:length], axis=0, out=table[length])
    return _Rows(table), None


def _shift_into(out: np.ndarray, rows: np.ndarray, k: int) -> None:
    """``out[r, c] = rows[r, c - k]`` as `_shift` with one shift ``k``, written into ``out``."""
    width = rows.shape[1]
    if k >= 0:
        out[:, : min(k, width)] = _INF
        if k < width:
            out[:, k:] = rows[:, : width - k]
    else:
        keep = max(width + k, 0)
        out[:, :keep] = rows[:, -k : -k + keep]
        out[:, keep:] = rows[:, width - 1 : width]


def _scaled(counts: np.ndarray, ms: np.ndarray) -> np.ndarray:
    """``counts * ms[:, None]``, inf staying inf when ``ms`` is 0."""
    out = counts * ms[:, None]
    out[np.isinf(counts)] = _INF
    return out


class _Rows:
    """``rows[l]`` is the one-row table of length ``l`` (a view); ``rows.table`` the whole."""

    def __init__(self, table: np.ndarray):
        self.table = table

    def __getitem__(self, length: int) -> np.ndarray:
        return self.table[length : length + 1]


def _inner_general(problem: ChainProblem, frame: _Frame):
    """Inner tables for unlike blocks: row a of ``inner[l]`` is the region ``[a, a+l)``."""
    blocks, width = problem.blocks, frame.width
    n = len(blocks)
    prefix = np.concatenate([[0.0], np.cumsum([b.fwd_ms for b in blocks])])
    inputs = np.array([b.input_slots for b in blocks])
    gp = frame.grad_prefix
    inner = [np.zeros((n + 1, width))]
    choice = [np.zeros((n + 1, width), dtype=np.int32)]
    for length in range(1, problem.segment_limit() + 1):
        rows = n - length + 1
        saving = np.array([b.stop_saving_ms for b in blocks[:rows]])
        best = _keep_first(blocks[:rows], inner[length - 1][1 : rows + 1], frame, length == 1, saving)
        pick = np.zeros((rows, width), dtype=np.int32)
        for j in range(1, length):
            fwd = (prefix[j : j + rows] - prefix[:rows])[:, None]
            held = inputs[:rows] - (gp[j : j + rows] - gp[:rows])
            cand = fwd + problem.segment_ms + inner[j][:rows] + _shift(inner[length - j][j : j + rows], held)
            better = cand < best
            best, pick = np.where(better, cand, best), np.where(better, j, pick)
        inner.append(best)
        choice.append(pick)
    return inner, choice


def _top(problem: ChainProblem, frame: _Frame, inner, alike: bool):
    """Top table, filled from the last block back; rows are start blocks ``a``."""
    blocks, width = problem.blocks, frame.width
    n = len(blocks)
    prefix = np.concatenate([[0.0], np.cumsum([b.fwd_ms for b in blocks])])
    gp = frame.grad_prefix
    top = np.full((n + 1, width), _INF)
    top[n, max(0, problem.post_slots - frame.lo) :] = 0.0
    for a in range(n - 1, -1, -1):
        block = blocks[a]
        opt_cost = _options_cost(block, top[a + 1], frame)
        longest = problem.longest_segment(a)
        if longest == 0:
            np.min(opt_cost, axis=0, out=top[a])
            continue
        js = np.arange(1, longest + 1)
        if alike:
            least_fwd = np.minimum.accumulate(prefix[a + 1 : a + longest + 1] - prefix[a : a + longest])
            seg_inner = _scaled(inner.table[1 : longest + 1], least_fwd)
        else:
            seg_inner = np.stack([inner[j][a] for j in js])
        rest = _shift(top[a + 1 : a + longest + 1], block.input_slots + problem.later(a, a + js) - (gp[a + js] - gp[a]))
        if problem.units is not None or problem.code_held_slots is not None:  # its unit gathered, the code's inputs
            seg_inner = _shift(seg_inner, problem.unit_slots(a, a + js))
        seg_cost = (prefix[a + js] - prefix[a])[:, None] + problem.segment_ms + seg_inner + rest
        if problem.forward is not None:  # the segment's forward holds every output for the model's calls
            seg_cost[_below(width, frame.lo, problem.forward_slots(a, a + js))] = _INF
        np.minimum(opt_cost.min(axis=0), seg_cost.min(axis=0), out=top[a])
    return top


def _options_cost(block: ChainBlock, rest: np.ndarray, frame: _Frame) -> np.ndarray:
    retained, working, extra = block.option_arrays
    out = extra[:, None] + _shift_row(rest, retained - block.grad_slots)
    out[_below(frame.width, frame.lo, working - block.grad_slots)] = _INF
    return out


_NONE = -(1 << 60)
"""Need of an empty region: no block, no constraint."""


def least_requirement(problem: ChainProblem) -> tuple[int, tuple[Element, ...]]:
    """Least free slots any layout needs (gradient-adjusted, as ``capacity_slots``) and one
    layout reaching it: a min-max DP over the same space as `solve_chain` (primes: minus the
    gradients, as in the module docstring), with the replay of a segment starting at ``a``
    (``first``) apart from the rest of a longer region starting there (``rest``):
    ``first[l][a] = min(max(work'_a, held'_a + rest[l-1][a+1]), child)`` and ``rest`` the same
    with the block's figures kept later in a replay (`ChainBlock.kept_slots`),
    ``child = min_{j<l} max(first[j][a], input'_[a,a+j) + rest[l-j][a+j])`` (in ``rest``,
    ``rest[j][a]``: a first child is replayed as its region, `remat.plan.predict.layout_peak`),
    of length 1 the block's need as a region's last, with the top level closing on the head's
    backward over ``first``."""
    blocks, n = problem.blocks, len(problem.blocks)
    gp = _frame(problem).grad_prefix
    empty = np.full(n + 1, _NONE, dtype=np.int64)
    first, rest, pick_first, pick_rest = [empty], [empty], [np.zeros(n + 1, dtype=np.int64)], [np.zeros(n + 1, dtype=np.int64)]
    inputs = np.array([b.input_slots for b in blocks], dtype=np.int64)
    grads = np.array([b.grad_slots for b in blocks], dtype=np.int64)
    # per block (held, working, working as a region's last), kept first or later in a replay
    kept = [np.array([b.kept_slots(f) for b in blocks], dtype=np.int64).reshape(n, 3) - grads[:, None]
            for f in (True, False)]
    alike = len({b.byte_signature() for b in blocks}) <= 1
    for length in range(1, n + 1):
        rows = n - length + 1
        if alike:
            picked = _least_alike(blocks[0], first, rest, length)
            for table, picks, (best, choice) in zip((first, rest), (pick_first, pick_rest), picked):
                table.append(np.full(rows, best, dtype=np.int64))
                picks.append(np.full(rows, choice, dtype=np.int64))
            continue
        after = rest[length - 1][1 : rows + 1]
        for table, picks, own in ((first, pick_first, kept[0]), (rest, pick_rest, kept[1])):
            child, choice = np.full(rows, -_NONE, dtype=np.int64), np.zeros(rows, dtype=np.int64)
            for j in range(1, length):  # a first child replayed as its region (its input is the region's)
                held = inputs[:rows] - (gp[j : j + rows] - gp[:rows])
                cand = np.maximum(table[j][:rows], held + rest[length - j][j : j + rows])
                better = cand < child
                child, choice = np.where(better, cand, child), np.where(better, j, choice)
            keep = np.maximum(own[:rows, 2 if length == 1 else 1], own[:rows, 0] + after)
            table.append(np.where(keep <= child, keep, child))
            picks.append(np.where(keep <= child, 0, choice))
    with deep_recursion(n):
        return _least_top(problem, first, (pick_first, pick_rest), gp)


def _least_alike(block: ChainBlock, first, rest, length: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """One length of the alike-block tables (``first``, ``rest``: (need, pick) each), every first
    child at once."""
    g = block.grad_slots
    firsts = np.array([first[j][0] for j in range(length)], dtype=np.int64)
    rests = np.array([rest[j][0] for j in range(length)], dtype=np.int64)
    keeps = []
    for held, work, last in (block.kept_slots(True), block.kept_slots(False)):
        keeps.append(max((last if length == 1 else work) - g, held - g + int(rests[length - 1])))
    if length == 1:
        return (keeps[0], 0), (keeps[1], 0)
    js = np.arange(1, length)
    out = []
    for keep, own in zip(keeps, (firsts, rests)):  # a first child replayed as its region
        cands = np.maximum(own[1:length], block.input_slots - js * g + rests[length - 1 : 0 : -1])
        j = int(np.argmin(cands))
        out.append((keep, 0) if keep <= cands[j] else (int(cands[j]), j + 1))
    return tuple(out)  # type: ignore[return-value]


def _least_top(problem: ChainProblem, need, picks, gp: np.ndarray) -> tuple[int, tuple[Element, ...]]:
    blocks, n = problem.blocks, len(problem.blocks)
    top = [0] * n + [problem.post_slots]
    code = [0] * (n + 1)
    for a in range(n - 1, -1, -1):
        g = blocks[a].grad_slots
        cands = [max(o.working_slots - g, o.retained_slots - g + top[a + 1]) for o in blocks[a].options]
        js = np.arange(1, problem.longest_segment(a) + 1)
        units, forwards, later = problem.unit_slots(a, a + js), problem.forward_slots(a, a + js), problem.later(a, a + js)
        cands += [max(int(need[j][a]) + int(u), blocks[a].input_slots + int(h) - int(gp[a + j] - gp[a]) + top[a + j], int(f))
                  for j, u, f, h in zip(js.tolist(), units.tolist(), forwards.tolist(), later.tolist())]
        k = int(np.argmin(cands))
        top[a] = cands[k]
        code[a] = -(k + 1) if k < len(blocks[a].options) else k - len(blocks[a].options) + 1
    layout, a = [], 0
    while a < n:
        if code[a] < 0:
            layout.append(Element(start=a, stop=a + 1, option=blocks[a].options[-code[a] - 1].label))
            a += 1
        else:
            layout.append(Element(start=a, stop=a + code[a], option=None, children=_least_inner(picks, a, code[a])))
            a += code[a]
    return top[0], tuple(layout)


def _least_inner(picks, a: int, length: int, table: int = 0) -> tuple[Element, ...]:
    """The children of the replay of a segment ``[a, a+length)`` (``picks``: the choices of the
    ``first`` and ``rest`` tables of `least_requirement`; ``table``: the segment's, 1 for a child
    after its parent's first element)."""
    out: list[Element] = []
    while length > 0:  # the segment's own replay; after its first element, the rest of it
        j = int(picks[table][length][a])
        if j:
            out.append(Element(start=a, stop=a + j, option=None, children=_least_inner(picks, a, j, table)))
        a, length, table = a + max(j, 1), length - max(j, 1), 1
    return tuple(out)
