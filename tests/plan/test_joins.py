"""Blocks that may not share a recompute segment (`ChainProblem.joins`), against enumeration.

``joins[i]`` False: blocks i and i + 1 are never in one multi-block recompute segment, at the
top level or nested. Both DPs (bytes and slots) and the least-peak DP must keep to it and stay
the optimum of the smaller space (`plan_space` enumerates it with the same mask).
"""

from __future__ import annotations

import random

import pytest

from remat.plan.chain_dp import BlockOption, ChainBlock, ChainProblem
from remat.plan.predict import predict
from remat.plan.search import OptimalSearch

from plan_space import enumerate_space
from plan_toys import chain, random_profile


def _segments(segments):
    for s in segments:
        yield s
        yield from _segments(s.children)


def _crossing(segments, joins) -> list[tuple[int, int]]:
    """Recompute segments, at any depth, holding blocks i and i + 1 where joins[i] is False."""
    return [(s.start, s.stop) for s in _segments(segments)
            if s.kind == "recompute" and not all(joins[s.start : s.stop - 1])]


@pytest.mark.parametrize("seed", range(8))
def test_joins_against_enumeration(seed):
    rng = random.Random(300 + seed)
    prof = random_profile(rng, rng.randint(3, 5))
    joins = tuple(rng.random() < 0.5 for _ in range(prof.num_blocks - 1))
    space = enumerate_space(prof, joins=joins)
    exact, slots = OptimalSearch(prof, joins=joins), OptimalSearch(prof, joins=joins, max_slots=10_000)
    for budget in sorted(set(space.peaks.tolist())):
        for search in (exact, slots):  # toy sizes: the slot is their gcd, 1 byte, so both are exact
            choice = search.choose(budget)
            got = predict(prof, choice.segments)
            assert got.peak_bytes <= budget
            assert got.step_ms == pytest.approx(space.best_ms(budget))
            assert _crossing(choice.segments, joins) == []
    least = exact.min_peak_segments()
    assert predict(prof, least).peak_bytes == space.peaks.min() and _crossing(least, joins) == []
    assert exact.choose(int(space.peaks.min()) - 1) is None


def test_no_joins_means_one_block_segments():
    prof = random_profile(random.Random(7), 4)
    joins = (False, False, False)
    space = enumerate_space(prof, joins=joins)
    for budget in sorted(set(space.peaks.tolist())):
        segments = OptimalSearch(prof, joins=joins).choose(budget).segments
        assert all(s.stop - s.start == 1 and not s.children for s in segments)
        assert predict(prof, segments).step_ms == pytest.approx(space.best_ms(budget))


def test_a_forbidden_join_costs_memory():
    """Four blocks holding 1 byte of input and 11 saved (1 ms forwards): one held input plus a
    working set, 12 bytes, needs the replay of blocks 0-2 as one segment with a child; with
    blocks 1 and 2 unable to join, the least is 13 bytes (two held inputs)."""
    prof = chain(4, input_bytes=1, saved_bytes=11)
    free, split = OptimalSearch(prof), OptimalSearch(prof, joins=(True, False, True))
    least = free.min_peak_segments()
    assert [(s.start, s.stop) for s in least] == [(0, 3), (3, 4)] and predict(prof, least).peak_bytes == 12
    assert predict(prof, split.min_peak_segments()).peak_bytes == 13
    assert split.choose(12) is None


def test_joins_of_the_wrong_length_are_refused():
    keep = BlockOption(label=0, retained_slots=1, working_slots=1, extra_ms=0.0)
    blocks = tuple(ChainBlock(input_slots=1, saved_slots=1, working_slots=1, fwd_ms=1.0, options=(keep,)) for _ in range(3))
    with pytest.raises(ValueError, match="joins has 3 entries for 3 blocks; give one per pair of neighbours \\(2\\)"):
        ChainProblem(blocks=blocks, post_slots=1, capacity_slots=4, joins=(True, True, False))
    with pytest.raises(ValueError, match="joins has 1 entries for a profile of 3 blocks; give one per pair"):
        OptimalSearch(random_profile(random.Random(1), 3), joins=(True,))
