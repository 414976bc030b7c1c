"""The chain DP exact in bytes: every table entry is a step function of the free memory.

Same plan space, recurrences and gradient adjustment as `remat.plan.chain_dp` (its docstring
defines the tables ``inner[l][a]`` and ``top[a]``); the sizes are bytes, not slots, and nothing
is rounded. A block kept first in its own segment's replay holds the input the checkpoint holds
and it does not save, and needs it through its backward; kept after another block of a replay it
does not (`remat.plan.chain_dp.ChainBlock.kept_slots`): ``inner[l]`` is the replay of a segment,
``rest[l]`` what follows a replay's first element, the same tables where no block differs so.
Instead of an array over memory columns each entry is the list of its breakpoints, ``(need,
cost)`` pairs with ``need`` rising and ``cost`` falling (a Pareto set): with ``m`` free
bytes the least extra ms is the cost of the last breakpoint whose need is <= m, infinite below
the first. The recurrences become operations on these lists:
- a held size shifts the needs of what follows (``f(m - h)``);
- a working set raises the needs below it to it (``f(m)`` only where ``m >= w``);
- a recompute child and what follows it add two step functions (breakpoints of both);
- the least over the choices merges the lists and keeps the Pareto set.
A breakpoint's need is the exact gradient-adjusted requirement of its layout, so one solve
answers every budget and `ExactSolution.curve` is the whole time-memory frontier of the space.
Each breakpoint records where it came from (its first choice and the breakpoints of the parts
after it), so a layout is read back without evaluating anything again.

All regions of one length are handled together (`_Packed`: one array, rows by start block). Cost:
one merge per length and first child for the replay tables (N^2 / 2, each over all regions) and
one per block for the top, each linear in the breakpoints, which grow with the chain and the
options. `solve_exact` gives up (None) when a forecast of the breakpoints still to handle passes
``max_points`` (on long chains first from a pilot solve of their last quarter); the search then
counts memory in slots (`remat.plan.chain_dp`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from remat.plan.chain_dp import ChainProblem, Element, deep_recursion
from remat.plan.options import undominated_rows

__all__ = ["ExactSolution", "solve_exact", "MAX_POINTS"]

MAX_POINTS = 4_000_000
"""Breakpoints `solve_exact` may handle (about 0.3 s)."""


class _TooLarge(Exception):
    """The breakpoints would outgrow ``max_points``."""


class _Top(NamedTuple):
    """``top[a]``'s breakpoints and where each came from."""

    need: np.ndarray
    """Rising int64 gradient-adjusted byte needs."""
    cost: np.ndarray
    """Falling extra ms."""
    stop: np.ndarray
    """End of the first element: ``a + 1`` for a per-block option, else a recompute segment's."""
    option: np.ndarray
    """Index of the per-block option in the block's options (-1: a recompute segment)."""
    inner: np.ndarray
    """The segment's replay: its breakpoint in ``inner[stop - a]`` (-1: an option)."""
    next: np.ndarray
    """The breakpoint of ``top[stop]`` the rest of the chain uses."""

    def locate(self, m: np.ndarray | int) -> np.ndarray:
        """Index of the breakpoint that holds at ``m`` (-1 below the first)."""
        return np.searchsorted(self.need, m, side="right") - 1


class _Packed(NamedTuple):
    """The replay regions of one length ``l``: row ``a`` is region ``[a, a+l)``, its breakpoints
    ``bounds[a]:bounds[a+1]`` of the arrays (sorted by row, then need), and where each came
    from: ``first`` 0 keeps block ``a`` (the rest of the region at breakpoint ``child`` of
    length ``l - 1``), ``j > 0`` replays a first child ``[a, a+j)`` at breakpoint ``child`` of
    length ``j`` and the rest at breakpoint ``rest`` of length ``l - j``."""

    need: np.ndarray
    cost: np.ndarray
    rows: np.ndarray
    bounds: np.ndarray
    first: np.ndarray
    child: np.ndarray
    rest: np.ndarray
    keys: np.ndarray
    """``rows * span + need - lo``: rising, so one search finds a row's breakpoint."""
    lo: int
    span: int

    def locate(self, rows: np.ndarray, m: np.ndarray) -> np.ndarray:
        """Index of row ``rows[i]``'s breakpoint that holds at ``m[i]`` (-1 below its first)."""
        if not self.need.size:
            return np.full(np.shape(m), -1)
        k = np.searchsorted(self.keys, rows * self.span + np.clip(m - self.lo, 0, self.span - 1), side="right") - 1
        return np.where((k >= 0) & (self.rows[np.maximum(k, 0)] == rows), k, -1)

    def part(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows ``first .. first+count-1``: (row less ``first``, need, global index)."""
        lo, hi = self.bounds[first], self.bounds[first + count]
        return self.rows[lo:hi] - first, self.need[lo:hi], np.arange(lo, hi)


def _cost_at(table, k: np.ndarray) -> np.ndarray:
    """Costs of breakpoints ``k`` (inf where -1)."""
    if not table.cost.size:
        return np.full(k.shape, np.inf)
    return np.where(k >= 0, table.cost[np.maximum(k, 0)], np.inf)


class ExactSolution:
    """The filled step functions; `cost(m)`, `layout(m)` and `curve()` read them (``m`` in
    gradient-adjusted free bytes, as `remat.plan.chain_dp.ChainProblem.capacity_slots`)."""

    def __init__(self, problem: ChainProblem, inner: list[_Packed], top: list[_Top], rest: list[_Packed] | None = None):
        self.problem, self.inner, self.top = problem, inner, top
        self.rest = inner if rest is None else rest

    def cost(self, m: int) -> float:
        """Least extra ms with ``m`` free bytes (inf: nothing fits)."""
        return float(_cost_at(self.top[0], np.array(self.top[0].locate(m))))

    def curve(self) -> list[tuple[int, float]]:
        """Every breakpoint ``(need, least extra ms)`` of the top, by rising need."""
        return list(zip(self.top[0].need.tolist(), self.top[0].cost.tolist()))

    def layout(self, m: int) -> tuple[Element, ...]:
        """Top-level elements of a least-time layout for ``m`` free bytes."""
        point = int(self.top[0].locate(m))
        assert point >= 0, f"no layout fits {m} free bytes"
        out: list[Element] = []
        a, n = 0, len(self.problem.blocks)
        with deep_recursion(n):
            while a < n:
                top = self.top[a]
                stop, option = int(top.stop[point]), int(top.option[point])
                if option >= 0:
                    out.append(Element(start=a, stop=stop, option=self.problem.blocks[a].options[option].label))
                else:
                    children = self._children(stop - a, int(top.inner[point]))
                    out.append(Element(start=a, stop=stop, option=None, children=children))
                a, point = stop, int(top.next[point])
        return tuple(out)

    def _children(self, length: int, point: int, tables: list[_Packed] | None = None) -> tuple[Element, ...]:
        """Recompute children of the replay of a segment of ``length`` blocks at its ``point``
        (in ``inner``, or ``tables``: a child's, those it was found in; what follows its first
        element, in ``rest``)."""
        out: list[Element] = []
        tables = self.inner if tables is None else tables
        while length > 0:
            table = tables[length]
            a, j = int(table.rows[point]), int(table.first[point])
            if j == 0:
                length, point, tables = length - 1, int(table.child[point]), self.rest
                continue
            out.append(Element(start=a, stop=a + j, option=None,
                               children=self._children(j, int(table.child[point]), tables)))
            length, point, tables = length - j, int(table.rest[point]), self.rest
        return tuple(out)


def solve_exact(problem: ChainProblem, max_points: int = MAX_POINTS) -> ExactSolution | None:
    """Fill the step functions (see the module docstring); None past ``max_points``."""
    budget = _Budget(max_points)
    try:
        _pilot(problem, budget)
        inner, rest = _inner_tables(problem, budget)
        top = _top_tables(problem, inner, budget)
    except _TooLarge:
        return None
    return ExactSolution(problem, inner, top, rest)


PILOT_BLOCKS = 16
"""Chains this long are first solved on their last quarter (`_pilot`)."""


def _pilot(problem: ChainProblem, budget: _Budget) -> None:
    """Solve the last quarter of a long chain first (its top is the whole chain's top there, its
    replay tables a 64th of the whole's) and give up at once when the top's breakpoints, grown in
    proportion to the blocks after each start, would pass the budget: the replay tables, the
    costlier part on long chains, are then never filled in vain."""
    n = len(problem.blocks)
    if n < PILOT_BLOCKS:
        return
    tail = n // 4
    joins = None if problem.joins is None else problem.joins[n - tail :]
    replayable = None if problem.replayable is None else problem.replayable[n - tail :]
    suffix = dataclasses.replace(problem, blocks=problem.blocks[n - tail :], joins=joins, replayable=replayable)
    size = _top_tables(suffix, _inner_tables(suffix, budget)[0], budget)[0].need.size
    budget.expect(size * sum((len(b.options) + 1) * (n - a) / tail for a, b in enumerate(problem.blocks[: n - tail])))


class _Budget:
    """Breakpoints left to handle; `expect` gives up early when a forecast of the work still to
    come (a lower estimate: the step functions only grow) exceeds what is left."""

    def __init__(self, points: int):
        self.left = points

    def spend(self, points: int) -> None:
        self.left -= points
        if self.left < 0:
            raise _TooLarge

    def expect(self, points: float) -> None:
        if points > self.left:
            raise _TooLarge


class _Kept(NamedTuple):
    """Per block, kept in a replay (gradient-adjusted): what it holds, its working set, and that
    as the region's last (its replay stops early)."""

    saved: np.ndarray
    work: np.ndarray
    last_work: np.ndarray


class _Arrays(NamedTuple):
    """Per block, gradient-adjusted (the module docstring of `remat.plan.chain_dp`)."""

    first: _Kept
    """Kept first in the replay of a segment starting at it (`remat.plan.chain_dp.ChainBlock.kept_slots`)."""
    later: _Kept
    """Kept after another block of the same replay."""
    inputs: np.ndarray
    grads: np.ndarray
    """Prefix sums of the gradients (N + 1)."""
    fwd: np.ndarray
    """Prefix sums of the forwards (N + 1)."""
    stop_saving: np.ndarray
    """What a region's last block's early stop takes off the replay (ms)."""


def _arrays(problem: ChainProblem) -> _Arrays:
    blocks = problem.blocks
    grad = np.array([b.grad_slots for b in blocks], dtype=np.int64)

    def kept(first: bool) -> _Kept:
        columns = np.array([b.kept_slots(first) for b in blocks], dtype=np.int64).reshape(len(blocks), 3)
        return _Kept(*(columns[:, k] - grad for k in range(3)))

    return _Arrays(
        first=kept(True),
        later=kept(False),
        inputs=np.array([b.input_slots for b in blocks], dtype=np.int64),
        grads=np.concatenate([[0], np.cumsum(grad)]).astype(np.int64),
        fwd=np.concatenate([[0.0], np.cumsum([b.fwd_ms for b in blocks])]),
        stop_saving=np.array([b.stop_saving_ms for b in blocks], dtype=float),
    )


def _inner_tables(problem: ChainProblem, budget: _Budget) -> tuple[list[_Packed], list[_Packed]]:
    """``inner[l]``: least replay ms of every segment of ``l`` blocks by free bytes, all regions
    of one length at once, up to the longest segment the joins allow (longer ones are unused);
    and ``rest[l]``, the same for what follows a replay's first element, whose first block, if
    kept, comes after another block of the replay (`remat.plan.chain_dp.ChainBlock.kept_slots`;
    ``rest`` is ``inner`` where no block's figures differ so). A child there is replayed as
    ``rest`` too: its input, saved into the parent's replay, is let go once the child's replay
    has run (`remat.plan.predict.layout_peak`). What it does not save is live beside the forwards
    of the child's later blocks in that replay, which these tables leave out: the search prices
    each layout it picks with `remat.plan.predict.predict`, which counts it."""
    n, arr = len(problem.blocks), _arrays(problem)
    longest = max((problem.longest_segment(a) for a in range(n)), default=0)
    none = np.zeros(0, dtype=np.int64)
    inner = [_pack(none, none, np.zeros(0), n + 1, (none, none, none))]
    alike = all(np.array_equal(x, y) for x, y in zip(arr.first, arr.later))
    rest = inner if alike else list(inner)
    for length in range(1, longest + 1):
        rows = n - length + 1
        own = [(inner, arr.first)] + ([] if alike else [(rest, arr.later)])
        for tables, kept in own:
            # a first child's replay is as its region's: the child's input is the region's
            children = [_child_first(tables[j], rest[length - j], arr, rows, j, problem.segment_ms) for j in range(1, length)]
            parts = [_keep_first(rest[length - 1], kept, arr.stop_saving, rows, length)] + children
            group, need, cost, first, child, after = (np.concatenate(column) for column in zip(*parts))
            budget.spend(need.size)
            index = _row_frontier(group, need, cost, rows)
            tables.append(_pack(group[index], need[index], cost[index], rows, (first[index], child[index], after[index])))
        # a longer length merges at least as many points per region and first child
        per_child = need.size / (rows * length)
        budget.expect(len(own) * per_child * sum((n - k + 1) * k for k in range(length + 1, longest + 1)))
    return inner, rest


def _keep_first(shorter: _Packed, kept: _Kept, stop_saving: np.ndarray, rows: int, length: int):
    """Points of keeping block ``a`` first in region ``[a, a+length)``: the rest of the region
    (row ``a + 1`` of ``shorter``) after its held bytes, from its working set on."""
    if length == 1:  # the region's last block: its replay stops early
        a, none = np.arange(rows), np.full(rows, -1)
        return a, kept.last_work[:rows], -stop_saving[:rows], np.zeros(rows, dtype=np.int64), none, none
    group, need, index = shorter.part(1, rows)
    need = np.maximum(need + kept.saved[group], kept.work[group])
    zeros, none = np.zeros(group.size, dtype=np.int64), np.full(group.size, -1)
    return group, need, shorter.cost[index], zeros, index, none


def _child_first(child: _Packed, rest: _Packed, arr: _Arrays, rows: int, j: int, segment_ms: float):
    """Points of a first child ``[a, a+j)`` then the rest ``[a+j, a+length)`` with the child's
    input held: ``child(m) + rest(m - held) + forwards`` at the breakpoints of both."""
    held = arr.inputs[:rows] - (arr.grads[j : j + rows] - arr.grads[:rows])
    plus = arr.fwd[j : j + rows] - arr.fwd[:rows] + segment_ms
    g1, n1, _ = child.part(0, rows)
    g2, n2, _ = rest.part(j, rows)
    group = np.r_[g1, g2]
    need = np.r_[n1, n2 + held[g2]]
    k1, k2 = child.locate(group, need), rest.locate(group + j, need - held[group])
    cost = _cost_at(child, k1) + _cost_at(rest, k2) + plus[group]
    return group, need, cost, np.full(group.size, j, dtype=np.int64), k1, k2


def _top_tables(problem: ChainProblem, inner: list[_Packed], budget: _Budget) -> list[_Top]:
    """``top[a]``: least extra ms of blocks ``a..N-1`` and the head's backward by free bytes.
    Each choice gives points and a way to say where a point came from, asked of the kept ones."""
    blocks, n, arr = problem.blocks, len(problem.blocks), _arrays(problem)
    none = np.full(1, -1)
    head = _Top(np.array([problem.post_slots]), np.zeros(1), none, none, none, none)  # the head's backward only
    top: list[_Top] = [None] * n + [head]  # type: ignore[list-item]
    for a in range(n - 1, -1, -1):
        parts = [_options(top[a + 1], blocks[a], a)]
        stops = np.arange(a + 1, a + problem.longest_segment(a) + 1)
        for b, unit, forward, later in zip(stops.tolist(), problem.unit_slots(a, stops).tolist(),
                                           problem.forward_slots(a, stops).tolist(), problem.later(a, stops).tolist()):
            parts.append(_segment(inner[b - a], top[b], arr, a, b, problem.segment_ms, unit, forward, later))
        need = np.concatenate([p[0] for p in parts])
        budget.spend(need.size)
        kept = _frontier(need, np.concatenate([p[1] for p in parts]))
        offsets = np.cumsum([0] + [p[0].size for p in parts])
        part = np.searchsorted(offsets, kept, side="right") - 1
        sources = np.zeros((4, kept.size), dtype=np.int64)
        for k in np.flatnonzero(np.bincount(part, minlength=len(parts))).tolist():
            mine = part == k
            sources[:, mine] = parts[k][2](kept[mine] - offsets[k])
        top[a] = _Top(need[kept], np.concatenate([p[1] for p in parts])[kept], *sources)
        budget.expect(top[a].need.size * sum(len(b.options) + 1 for b in blocks[:a]))
    return top


def _options(rest: _Top, block, a: int):
    """Points of ``extra_o + rest(m - retained'_o)`` from ``working'_o`` on, over the block's
    options ``o`` (primes: less the block's gradients), all at once. An option needs
    ``max(working'_o, retained'_o + rest's least need)``; one that needs, holds and costs no less
    than an earlier one adds nothing and is dropped first."""
    retained, working, extra = block.option_arrays
    if not rest.need.size:
        return np.zeros(0, dtype=np.int64), np.zeros(0), None
    retained = retained - block.grad_slots
    working = np.maximum(working - block.grad_slots, retained + rest.need[0])
    useful = np.flatnonzero(undominated_rows(retained, working, extra[None, :])[0])
    need = np.maximum(rest.need[None, :] + retained[useful, None], working[useful, None]).ravel()
    cost = (rest.cost[None, :] + extra[useful, None]).ravel()
    size = rest.need.size

    def source(index: np.ndarray) -> tuple:
        return np.full(index.size, a + 1), useful[index // size], np.full(index.size, -1), index % size

    return need, cost, source


def _segment(region: _Packed, rest: _Top, arr: _Arrays, a: int, b: int, segment_ms: float, unit: int = 0,
             forward: int = -(1 << 60), later: int = 0):
    """Points of a recompute segment ``[a, b)``: its replay (row ``a`` of ``region``) at ``m``
    less ``unit`` (what its FSDP unit gathers beyond the largest block's:
    `remat.plan.chain_dp.ChainProblem.unit_slots`) and the rest of the chain after its held
    input and ``later`` (`remat.plan.chain_dp.ChainProblem.later`), at the breakpoints of both;
    none below ``forward``, its forward's need (`remat.plan.chain_dp.ChainProblem.forward_slots`)."""
    held = int(arr.inputs[a] + later - (arr.grads[b] - arr.grads[a]))
    _, own, _ = region.part(a, 1)
    need = np.maximum(np.r_[own + unit, rest.need + held], forward)
    k1 = region.locate(np.full(need.size, a), need - unit)
    k2 = rest.locate(need - held)
    cost = _cost_at(region, k1) + _cost_at(rest, k2) + float(arr.fwd[b] - arr.fwd[a]) + segment_ms

    def source(index: np.ndarray) -> tuple:
        return np.full(index.size, b), np.full(index.size, -1), k1[index], k2[index]

    return need, cost, source


def _frontier(need: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """Indices of the Pareto set of points ``(need, cost)``: by rising need, the points where
    the least cost so far strictly falls, one per need (the last fall within a need's points)."""
    order = np.argsort(need)  # of equal needs any order: the last fall among them is their least
    need, cost = need[order], cost[order]
    least = np.minimum.accumulate(cost)
    falls = np.flatnonzero(np.r_[np.isfinite(least[:1]), least[1:] < least[:-1]])
    same_need = need[falls][1:] == need[falls][:-1]
    return order[falls[np.r_[~same_need, True]]]


def _row_frontier(group: np.ndarray, need: np.ndarray, cost: np.ndarray, num_rows: int) -> np.ndarray:
    """Indices of the Pareto set of each row's points: sorted by one key (row, then need), one
    point of least cost per need, then a running minimum row by row."""
    finite = np.flatnonzero(np.isfinite(cost))
    if not finite.size:
        return finite
    lo = int(need[finite].min())
    span = int(need[finite].max()) - lo + 1
    if span * (num_rows + 1) >= 1 << 62:
        raise _TooLarge  # the keys would overflow int64
    key = group[finite] * span + (need[finite] - lo)
    sorter = np.argsort(key)
    order, key, cost = finite[sorter], key[sorter], cost[finite[sorter]]
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    run = np.cumsum(np.r_[True, key[1:] != key[:-1]]) - 1
    at_least = np.flatnonzero(cost == np.minimum.reduceat(cost, starts)[run])
    firsts = at_least[np.r_[True, run[at_least][1:] != run[at_least][:-1]]]  # one least point per need
    order, cost, rows = order[firsts], cost[firsts], group[order[firsts]]
    keep = np.empty(order.size, dtype=bool)
    bounds = np.searchsorted(rows, np.arange(num_rows + 1))
    for lo_, hi_ in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        if hi_ > lo_:
            keep[lo_] = True
            keep[lo_ + 1 : hi_] = cost[lo_ + 1 : hi_] < np.minimum.accumulate(cost[lo_ : hi_ - 1])
    return order[keep]


def _pack(rows: np.ndarray, need: np.ndarray, cost: np.ndarray, num_rows: int, source) -> _Packed:
    """Breakpoints sorted by row then need, with their search keys and where they came from."""
    lo = int(need.min()) - 1 if need.size else 0
    span = int(need.max()) - lo + 1 if need.size else 1
    if span * (num_rows + 1) >= 1 << 62:
        raise _TooLarge  # the keys would overflow int64
    first, child, rest = source
    return _Packed(need=need, cost=cost, rows=rows, bounds=np.searchsorted(rows, np.arange(num_rows + 1)),
                   first=first, child=child, rest=rest, keys=rows * span + (need - lo), lo=lo, span=span)
