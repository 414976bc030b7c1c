"""Every layout of a profile's plan space, priced: the oracle the optimal planner is tested against.

A layout is a sequence of top-level elements covering the blocks: one block with a per-block
option (`remat.plan.search.block_options`: keep, the named selective policies, every knapsack
point, offload where the profile has rates), or a recompute segment [a, b) whose replay is itself
a sequence of kept blocks and recompute children strictly inside it, nested to any depth.

Each element is priced once with `predict`'s own parts (`cost_of`, `layout_peak`): what it holds
afterwards, its own highest need above what was held before it, its time and offloaded bytes.
The layouts are then enumerated element by element, combining those prices as `predict` combines
its top-level segments (`tests/plan/test_exact.py` checks the combination against `predict` on
layouts drawn from the whole space). Per block, an option that holds, needs, costs and offloads no
less than another option of the same block is left out (``prune``): swapping it for that one
never raises a phase of the peak, the time or the offloaded bytes, so no layout left out is
better than one enumerated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from remat.plan.costs import cost_of
from remat.plan.head import head_choices, priced_profile
from remat.plan.joins import joins as block_joins
from remat.plan.phases import segment_forward_bytes, unit_extra_bytes
from remat.plan.predict import (_extras, backward_base_bytes, baseline_step_ms, fresh_memory, grad_bytes_live, layout_peak,
                                predict)
from remat.plan.search import block_options
from remat.plan.types import Segment


@dataclass(frozen=True)
class Priced:
    """One top-level element, priced."""

    segment: Segment
    held_bytes: int
    """What it holds while backward runs the later blocks."""
    need_bytes: int
    """Its highest need above what earlier elements hold (its own backward or its replay)."""
    extra_ms: float
    offloaded_bytes: int


def region_layouts(a: int, b: int, parent: tuple[int, int]):
    """Every layout of part [a, b) of the replay of segment ``parent``: kept blocks and
    recompute children nested to any depth, none covering the whole ``parent``."""
    if a == b:
        yield ()
        return
    yield from region_layouts(a + 1, b, parent)  # block a kept during the replay
    for j in range(a + 1, b + 1):
        if (a, j) == parent:
            continue
        for inner in region_layouts(a, j, (a, j)):
            for rest in region_layouts(j, b, parent):
                yield (Segment(start=a, stop=j, strategy="recompute", children=inner),) + rest


def _price(profile, segment: Segment) -> Priced:
    a = segment.start
    cost = cost_of(profile, a, segment)
    extra_ms, _, offloaded = _extras(profile, (segment,))
    if segment.kind == "recompute":
        need = layout_peak(profile, segment.children, a, segment.stop, replay=True, stopped=segment.stops_early).bytes
        need += unit_extra_bytes(profile, a, segment.stop)  # ZeRO-3: the segment is one unit
        need = max(need, segment_forward_bytes(profile, a, segment.stop))  # its forward holds every output
    else:
        need = cost.working_bytes + grad_bytes_live(profile, a)
    return Priced(segment=segment, held_bytes=cost.retained_bytes, need_bytes=need, extra_ms=extra_ms,
                  offloaded_bytes=offloaded)


def prune(priced: list[Priced]) -> list[Priced]:
    """The options no other option of the block matches or beats in all four figures (of equal
    ones, the first)."""
    keys = [(p.held_bytes, p.need_bytes, p.extra_ms, p.offloaded_bytes) for p in priced]
    out = []
    for i, key in enumerate(keys):
        beaten = any(all(o <= k for o, k in zip(other, key)) and (other != key or j < i)
                     for j, other in enumerate(keys) if j != i)
        if not beaten:
            out.append(priced[i])
    return out


def element_tables(profile, joins=None, options=True) -> list[list[Priced]]:
    """Per start block, every first element (pruned per-block options, then recompute segments
    with every nested layout; ``joins[i]`` False: no segment holds blocks i and i + 1). ``options``:
    every per-block option (True), keep alone (False), or those a callable takes."""
    n, out = profile.num_blocks, []
    for a in range(n):
        chosen = [s for s in block_options(profile, a) if options is True or callable(options) and options(s)]
        singles = [_price(profile, s) for s in chosen or [Segment(start=a, stop=a + 1, strategy="keep")]]
        elements = prune(singles)
        for b in range(a + 1, n + 1):
            if joins is not None and b - a > 1 and not all(joins[a : b - 1]):
                break
            for children in region_layouts(a, b, (a, b)):
                elements.append(_price(profile, Segment(start=a, stop=b, strategy="recompute", children=children)))
        out.append(elements)
    return out


def layouts(tables: list[list[Priced]], a: int = 0):
    """Every layout from block ``a``: tuples of priced elements."""
    if a == len(tables):
        yield ()
        return
    for element in tables[a]:
        for rest in layouts(tables, element.segment.stop):
            yield (element,) + rest


def combine(profile, elements) -> tuple[int, float]:
    """(peak bytes, step ms) of a layout, as `predict` combines its top-level segments."""
    held, need, offloaded, extra = 0, 0, 0, 0.0
    for e in elements:
        need = max(need, held + e.need_bytes)
        held += e.held_bytes
        offloaded += e.offloaded_bytes
        extra += e.extra_ms
    return _finish(profile, held, need, offloaded, extra)


def _finish(profile, held: int, need: int, offloaded: int, extra: float) -> tuple[int, float]:
    base = backward_base_bytes(profile) + profile.fixed_pre_saved_bytes
    post = base + held + profile.fixed_post_saved_bytes + profile.fixed_post_bwd_temp_bytes
    peak = max(base + need, post, profile.model_state_bytes + profile.optimizer_step_temp_bytes)
    return peak, baseline_step_ms(profile) + extra - fresh_memory(profile, peak, offloaded)[1]


@dataclass(frozen=True)
class Space:
    """The priced plan space: every layout's peak and step time (``np`` arrays, one per layout)."""

    peaks: np.ndarray
    step_ms: np.ndarray

    def best_ms(self, budget: int) -> float:
        """Least step time of a layout that fits ``budget`` (inf: none)."""
        fits = self.peaks <= budget
        return float(self.step_ms[fits].min()) if fits.any() else math.inf

    def frontier(self) -> list[tuple[int, float]]:
        """(peak, step ms) of the layouts no other is both lower and faster than, by rising peak."""
        order = np.lexsort((self.step_ms, self.peaks))
        out, best = [], math.inf
        for k in order:
            if self.step_ms[k] < best - 1e-9:
                out.append((int(self.peaks[k]), float(self.step_ms[k])))
                best = self.step_ms[k]
        return out


def enumerate_space(profile, joins=None, options=True) -> Space:
    """Every layout's peak and time, element by element (a layout's prefix is combined once)."""
    tables = element_tables(profile, joins, options)
    peaks, times = [], []

    def walk(a: int, held: int, need: int, offloaded: int, extra: float) -> None:
        if a == len(tables):
            peak, ms = _finish(profile, held, need, offloaded, extra)
            peaks.append(peak)
            times.append(ms)
            return
        for e in tables[a]:
            walk(e.segment.stop, held + e.held_bytes, max(need, held + e.need_bytes), offloaded + e.offloaded_bytes,
                 extra + e.extra_ms)

    walk(0, 0, 0, 0, 0.0)
    return Space(peaks=np.array(peaks, dtype=np.int64), step_ms=np.array(times))


@dataclass(frozen=True)
class Predicted:
    """Every layout of `element_tables` under every head strategy worth searching, each priced by
    `predict` itself (`predicted_space`)."""

    space: Space
    heads: tuple[str, ...]
    """Per layout, its head strategy."""
    combined_apart: int
    """Layouts whose peak `combine` puts elsewhere than `predict` does."""


def predicted_space(profile, options=True) -> Predicted:
    """Every layout of the profile's blocks (`element_tables`, the profile's breaks between blocks
    kept: `remat.plan.joins`) with every head strategy of `remat.plan.head.head_choices`, priced by
    `predict` whole. `combine` adds up a layout's elements without the terms `predict` weighs for
    the layout as a whole (what a kept block saves that the post part's backward no longer holds,
    shared tensors a plan keeps alive or lets go, outputs the code holds to the loss): on models
    where those terms are not zero this is the oracle, at the cost of one `predict` per layout.
    ``options``: the per-block options (`element_tables`)."""
    peaks, times, heads, apart = [], [], [], 0
    for head in head_choices(profile):
        priced = priced_profile(profile, head)
        for elements in layouts(element_tables(priced, block_joins(priced), options)):
            prediction = predict(profile, tuple(e.segment for e in elements), head)
            peaks.append(prediction.peak_bytes)
            times.append(prediction.step_ms)
            heads.append(head)
            apart += combine(priced, elements)[0] != prediction.peak_bytes
    return Predicted(space=Space(peaks=np.array(peaks, dtype=np.int64), step_ms=np.array(times)), heads=tuple(heads),
                     combined_apart=apart)
