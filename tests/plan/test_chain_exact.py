"""The chain DP in bytes (`remat.plan.chain_exact`) against the slot DP on problems whose sizes are
small integers: the slot DP then counts every unit too, and is exact (`tests/plan/test_optimal.py`
checks it against enumeration), so both must give the same least time at every memory column,
and the byte DP's layouts must cost what it says. Odd seeds add masks: pairs of blocks that may
not share a segment (joins), blocks that may not be replayed."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from remat.plan.chain_dp import BlockOption, ChainBlock, ChainProblem, UnitSlots, least_requirement, solve_chain
from remat.plan.chain_exact import solve_exact

EXACT_TABLES = 10**12
"""``exact_cells`` that makes the slot DP fill its exact per-region tables."""


def _problem(rng: random.Random, num_blocks: int, joins: bool) -> ChainProblem:
    blocks = []
    for i in range(num_blocks):
        inp, saved, grad = rng.randint(1, 3), rng.randint(4, 9), rng.randint(0, 2)
        work = saved + rng.randint(0, 3)
        options = [BlockOption(label=0, retained_slots=saved, working_slots=work, extra_ms=0.0)]
        for k in range(rng.randint(0, 2)):  # selective-like: hold less, pay some
            held = rng.randint(inp, saved - 1)
            options.append(BlockOption(label=k + 1, retained_slots=held, working_slots=work + rng.randint(0, 2),
                                       extra_ms=rng.randint(1, 6) / 4))
        fwd = rng.randint(1, 9) / 2
        # the last block of a replay region stops early: it may work with less and replay less
        stop_work, stop_saving = work - rng.randint(0, 3), rng.randint(0, int(2 * fwd)) / 4
        blocks.append(ChainBlock(input_slots=inp, saved_slots=saved, working_slots=work, fwd_ms=fwd,
                                 options=tuple(options), grad_slots=grad, stop_working_slots=stop_work,
                                 stop_saving_ms=stop_saving))
    mask = tuple(rng.random() < 0.7 for _ in range(num_blocks - 1)) if joins else None
    replayable = tuple(rng.random() < 0.8 for _ in range(num_blocks)) if joins else None
    return ChainProblem(blocks=tuple(blocks), post_slots=rng.randint(1, 6), capacity_slots=80,
                        segment_ms=rng.choice([0.0, 0.25]), joins=mask, replayable=replayable)


@pytest.mark.parametrize("seed", range(10))
def test_byte_tables_equal_exact_slot_tables(seed):
    rng = random.Random(seed)
    problem = _problem(rng, rng.randint(2, 7), joins=seed % 2 == 1)
    slots, exact = solve_chain(problem, exact_cells=EXACT_TABLES), solve_exact(problem)
    columns = [m for m, cost in slots.curve() if math.isfinite(cost)]
    assert exact.curve()[0][0] == min(columns)  # the same least need
    for m in columns:
        assert exact.cost(m) == pytest.approx(slots.cost(m), abs=1e-9)
        assert slots.layout_ms(exact.layout(m)) == pytest.approx(exact.cost(m), abs=1e-9)
    assert exact.cost(min(columns) - 1) == math.inf
    needs, costs = zip(*exact.curve())
    assert list(needs) == sorted(set(needs)) and list(costs) == sorted(costs, reverse=True)


@pytest.mark.parametrize("num_blocks", [7, 18])
@pytest.mark.parametrize("joins", [False, True])
def test_too_many_points_give_up(num_blocks, joins):
    """Past ``max_points`` the DP gives up (18 blocks: after a pilot on the last 4), else it is
    the slot DP's optimum; with blocks that may not join or be replayed too (the pilot's chain
    is the last 4 of each: RT-DETR's 40 blocks, some not replayable, raised in the pilot)."""
    problem = _problem(random.Random(3), num_blocks, joins=joins)
    assert solve_exact(problem, max_points=50) is None
    exact, slots = solve_exact(problem), solve_chain(problem, exact_cells=EXACT_TABLES)
    assert [exact.cost(m) for m, _ in slots.curve()] == pytest.approx([cost for _, cost in slots.curve()], abs=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_segments_as_fsdp_units_the_same_in_both(seed):
    """ZeRO-3: a recompute segment of several blocks gathers its blocks' weights together
    (`UnitSlots`), which raises its replay's need by a sum over its blocks; both DPs price it
    alike, the slot DP's layouts read back at that need, and the least need agrees too."""
    rng = random.Random(100 + seed)
    plain = _problem(rng, rng.randint(3, 6), joins=seed % 2 == 1)
    unit_bytes = tuple(rng.randint(1, 4) * 2 for _ in plain.blocks)
    if seed >= 4:  # alike blocks: the slot DP's shared replay tables
        plain = dataclasses.replace(plain, blocks=(plain.blocks[0],) * len(plain.blocks), joins=None, replayable=None)
        unit_bytes = (unit_bytes[0],) * len(unit_bytes)
    units = UnitSlots(unit_bytes=unit_bytes, quantum=1)
    problem = dataclasses.replace(plain, units=units)
    extra = problem.unit_slots(0, [1, 2, len(plain.blocks)])
    assert extra[0] == 0 and extra[2] > 0  # one block: its own unit; the whole chain: more than the largest
    slots, exact = solve_chain(problem, exact_cells=EXACT_TABLES), solve_exact(problem)
    columns = [m for m, cost in slots.curve() if math.isfinite(cost)]
    assert exact.curve()[0][0] == min(columns) == least_requirement(problem)[0]
    for m in columns:
        assert exact.cost(m) == pytest.approx(slots.cost(m), abs=1e-9)
        assert slots.layout_ms(slots.layout(m)) == pytest.approx(slots.cost(m), abs=1e-9)
        assert slots.layout_ms(exact.layout(m)) == pytest.approx(exact.cost(m), abs=1e-9)
    # the units cost memory: nothing needs less than without them, and a long segment needs more
    assert min(columns) >= min(m for m, cost in solve_chain(plain, exact_cells=EXACT_TABLES).curve() if math.isfinite(cost))
