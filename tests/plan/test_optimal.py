"""The optimal planner against exhaustive enumeration, Revolve's bound and sqrt(N) scaling.

The plan space enumerated here is the one `optimal` searches: a sequence of top-level elements
covering the blocks, each either one block with a per-block option (keep, selective with the
named policies' or any knapsack-frontier op set; no offload cost is registered in these
profiles) or a recompute segment [a, b); inside a recompute segment the replay is itself a
sequence of kept blocks and recompute children [c, d) strictly inside [a, b), nested to any depth.
"""

import dataclasses
import math
import random

import numpy as np
import pytest

from remat.plan.planners import pareto, plan
from remat.plan.predict import predict
from remat.plan.search import block_options
from remat.plan.types import Segment

from plan_space import region_layouts
from plan_toys import block, chain, op, profile, random_profile


def _tops(prof, a):
    n = prof.num_blocks
    if a == n:
        yield ()
        return
    for option in block_options(prof, a):
        for rest in _tops(prof, a + 1):
            yield (option,) + rest
    for j in range(a + 1, n + 1):
        for children in region_layouts(a, j, (a, j)):
            for rest in _tops(prof, j):
                yield (Segment(start=a, stop=j, strategy="recompute", children=children),) + rest


def _space(prof):
    """(peak, step ms) of every plan in the space, fastest first for each peak."""
    points = {}
    for segments in _tops(prof, 0):
        pred = predict(prof, segments)
        points[pred.peak_bytes] = min(points.get(pred.peak_bytes, math.inf), pred.step_ms)
    return sorted(points.items())


def _best(space, budget):
    return min((ms for peak, ms in space if peak <= budget), default=math.inf)


def _count(prof):
    return sum(1 for _ in _tops(prof, 0))


def _with_ops(prof, rng):
    """Give every other block three op calls so selective options join the space."""
    blocks = list(prof.blocks)
    for i in range(0, len(blocks), 2):
        b = blocks[i]
        ops = tuple(op(f"aten.{name}.default#0", rng.randint(1, 3), 1, float(rng.randint(1, 3)) / 4)
                    for name in ("mm", "relu", "bmm"))
        blocks[i] = block(i, input_bytes=b.input_bytes, saved_bytes=b.saved_bytes, bwd_temp_bytes=b.bwd_temp_bytes,
                          fwd_ms=b.fwd_ms, ops=ops)
    return profile(blocks, **{k: getattr(prof, k) for k in ("param_bytes", "grad_bytes", "fixed_pre_saved_bytes",
                                                             "fixed_post_saved_bytes", "fixed_post_bwd_temp_bytes")})


def test_enumeration_counts_nested_layouts():
    # 1 block: keep, recompute -> 2. 2 blocks: 2 * 2, plus [0,2) whose replay has children
    # (), ([0,1),), ([1,2),), ([0,1), [1,2)) -> 8. The space grows fast: 25216 layouts of 6
    # keep/recompute blocks, 2190848 of 8 (too many to price in a unit test), so the random
    # profiles below have 2 to 5 blocks.
    assert [_count(chain(n, input_bytes=1, saved_bytes=2)) for n in (1, 2, 3, 4)] == [2, 8, 48, 352]


def _check_against_space(prof):
    space = _space(prof)
    low, high = space[0][0], space[-1][0]
    for budget in sorted({low - 1, *(low + k * (high - low) // 5 for k in range(6))}):
        expected = _best(space, budget)
        if math.isinf(expected):
            with pytest.raises(ValueError, match="minimum feasible peak|Model state alone needs"):
                plan(prof, budget=budget)
            continue
        got = plan(prof, budget=budget)
        assert got.prediction.peak_bytes <= budget
        assert got.prediction.step_ms == pytest.approx(expected)


@pytest.mark.parametrize("seed", range(12))
def test_optimal_equals_exhaustive_enumeration(seed):
    rng = random.Random(seed)
    if seed % 2:
        _check_against_space(_with_ops(random_profile(rng, rng.randint(2, 4)), rng))
    else:
        _check_against_space(random_profile(rng, rng.randint(2, 5)))


def _with_call_cost(prof, rng, call_ms):
    """Checkpoint overheads per block, of which one checkpointed call's cost is ``call_ms``
    (paid once per segment, top level or nested)."""
    blocks = [dataclasses.replace(b, recompute_overhead_ms=call_ms + rng.randint(0, 3) / 4) for b in prof.blocks]
    return dataclasses.replace(prof, blocks=tuple(blocks), checkpoint_call_ms=call_ms)


@pytest.mark.parametrize("seed", range(6))
def test_optimal_equals_exhaustive_enumeration_with_a_cost_per_segment(seed):
    # a segment of k blocks pays the checkpointed call's cost once: the DP charges it per
    # segment, predict on the segment's first block; both must agree on every layout
    rng = random.Random(100 + seed)
    prof = random_profile(rng, rng.randint(2, 5))
    _check_against_space(_with_call_cost(prof if seed % 2 else _with_ops(prof, rng), rng, 1.5))


@pytest.mark.parametrize("num_blocks", [3, 5])
def test_alike_chain_with_a_cost_per_segment_is_exact(num_blocks):
    # alike blocks share one replay table in units of block forwards: the segment's cost joins
    # it as a fraction of a forward (equal forwards: exact)
    prof = chain(num_blocks, input_bytes=1, saved_bytes=3, param_bytes=2, grad_bytes=2)
    prof = dataclasses.replace(prof, checkpoint_call_ms=0.75,
                               blocks=tuple(dataclasses.replace(b, recompute_overhead_ms=1.0) for b in prof.blocks))
    _check_against_space(prof)


def test_segment_cost_is_paid_once_per_segment():
    prof = chain(3, input_bytes=1, saved_bytes=3)
    prof = dataclasses.replace(prof, checkpoint_call_ms=0.5,
                               blocks=tuple(dataclasses.replace(b, recompute_overhead_ms=0.75) for b in prof.blocks))
    one = (Segment(start=0, stop=3, strategy="recompute"),)
    each = tuple(Segment(start=i, stop=i + 1, strategy="recompute") for i in range(3))
    nested = (Segment(start=0, stop=3, strategy="recompute", children=(Segment(start=1, stop=3, strategy="recompute"),)),)
    # forward 1 ms a block; overhead 0.75 a block, of which 0.5 once per segment
    assert predict(prof, one).extra_ms == 3 * 1.0 + 0.5 + 3 * 0.25
    assert predict(prof, each).extra_ms == 3 * (1.0 + 0.75)
    assert predict(prof, nested).extra_ms == (3 * 1.0 + 0.5 + 3 * 0.25) + (2 * 1.0 + 0.5 + 2 * 0.25)


def test_pareto_equals_enumerated_frontier():
    rng = random.Random(3)
    prof = _with_ops(random_profile(rng, 4), rng)
    space = _space(prof)
    frontier, best = [], math.inf
    for peak, ms in space:
        if ms < best - 1e-9:
            frontier.append((peak, ms))
            best = ms
    got = [(p.prediction.peak_bytes, p.prediction.step_ms) for p in pareto(prof)][::-1]
    assert [g[0] for g in got] == [f[0] for f in frontier]
    assert [g[1] for g in got] == pytest.approx([f[1] for f in frontier])


@pytest.mark.parametrize(("length", "slots", "revolve"), [(100, 10, 222), (1000, 10, 3636), (20, 3, 45), (30, 1, 435)])
def test_revolve_bound_on_homogeneous_chains(length, slots, revolve):
    """Slots: each block's input is 1 byte and its saved bytes 11 (> slots, so no two blocks
    can be kept at once); a budget of ``slots`` + 11 bytes holds ``slots`` block inputs, the
    chain's input (block 0's input) counting as one, plus one block's working set. The last
    block is then kept and every other block replayed at least once: the block forwards added
    are Griewank & Walther's t(l, s) = r*l - C(s+r, s+1), r least with C(s+r, s) >= l.

    Outputs cost nothing here: in remat's runtime a top-level segment's forward holds every
    block's output for the model's own calls (`remat.plan.phases.segment_forward_bytes`), which
    Revolve's model has no term for; `test_a_long_segment_holds_every_output_in_its_forward`
    prices that."""
    r = next(r for r in range(1, length + 1) if math.comb(slots + r, slots) >= length)
    assert r * length - math.comb(slots + r, slots + 1) == revolve
    prof = chain(length, input_bytes=1, saved_bytes=11, output_bytes=0)
    got = plan(prof, budget=slots + 11)
    assert got.prediction.extra_ms == revolve  # fwd_ms = 1 per block
    assert got.prediction.extra_flops == 100 * revolve
    assert got.prediction.peak_bytes == slots + 11
    if length <= 100:
        with pytest.raises(ValueError, match=r"minimum feasible peak .* is 12 B"):
            plan(prof, budget=11)  # one slot (the chain's input) plus one working set is the least


def test_a_long_segment_holds_every_output_in_its_forward():
    """The model calls each block; the runtime runs a segment's blocks at its first block's call
    and holds each output until the model calls the next block. The forward of one segment over
    the whole chain holds its input and every output: with 1-byte outputs, the least peak of 30
    blocks is no longer 12 bytes (Revolve's, the replays alone) but the forward's 1 + 30."""
    from remat.plan.phases import segment_forward_bytes

    prof = chain(30, input_bytes=1, saved_bytes=11)
    assert segment_forward_bytes(prof, 0, 30) == 1 + 29 + 1  # input, 29 outputs held, the last block's output
    least = min(p.prediction.peak_bytes for p in pareto(prof))
    assert plan(prof, budget=least).prediction.peak_bytes == least > 12
    with pytest.raises(ValueError, match="minimum feasible peak"):
        plan(prof, budget=least - 1)


def test_sqrt_retains_order_sqrt_n():
    sizes = [16, 64, 256, 1024]
    peaks = []
    for n in sizes:
        prof = chain(n, input_bytes=1000, saved_bytes=4000)
        peaks.append(plan(prof, strategy="sqrt").prediction.peak_bytes)
    slope = np.polyfit(np.log(sizes), np.log(peaks), 1)[0]
    assert 0.4 <= slope <= 0.6
    # N = 16: 4 segments of 4; b15's backward: 3 held inputs + 3 kept blocks in the replay + working.
    assert peaks[0] == 3 * 1000 + 3 * 4000 + 4000


def test_fixed_strategies_layouts():
    prof = chain(5, input_bytes=1, saved_bytes=3)
    assert [(s.start, s.stop, s.strategy) for s in plan(prof, strategy="every:2").segments] == [
        (0, 2, "recompute"), (2, 4, "recompute"), (4, 5, "recompute")]
    assert plan(prof, strategy="none").block_strategies() == ("keep",) * 5
    assert plan(prof, strategy="full").block_strategies() == ("recompute",) * 5
    with pytest.raises(ValueError, match="needs a positive segment length"):
        plan(prof, strategy="every:0")
    with pytest.raises(ValueError, match="unknown strategy 'fastest'"):
        plan(prof, strategy="fastest")
    with pytest.raises(ValueError, match="takes no argument"):
        plan(prof, strategy="sqrt:2")


def test_fixed_strategy_over_budget_names_optimal():
    prof = chain(4, input_bytes=1, saved_bytes=3)
    with pytest.raises(ValueError, match="strategy 'none' predicts a peak of .* 'optimal' fits it"):
        plan(prof, budget=8, strategy="none")


def test_pareto_frontier():
    prof = chain(6, input_bytes=1, saved_bytes=4)
    frontier = pareto(prof)
    peaks = [p.prediction.peak_bytes for p in frontier]
    times = [p.prediction.step_ms for p in frontier]
    assert peaks == sorted(peaks, reverse=True) and times == sorted(times)
    assert len(set(peaks)) == len(peaks) and len(set(times)) == len(times)
    assert frontier[0].prediction.extra_ms == 0.0  # no recomputation first
    least = frontier[-1].prediction.peak_bytes
    assert plan(prof, budget=least).prediction.peak_bytes == least
    with pytest.raises(ValueError, match="minimum feasible peak"):
        plan(prof, budget=least - 1)
    for p in frontier:  # each point is the optimum at its own peak
        assert plan(prof, budget=p.prediction.peak_bytes).prediction.step_ms == p.prediction.step_ms


def test_offload_joins_the_search_when_costed_and_measured():
    """With measured host<->device rates on a CUDA profile, `optimal` may offload a block: here
    transfers hide fully behind compute (overlap 1), so offloading the big block beats
    recomputing it; without rates offload is never offered."""
    from remat.measure.types import Bandwidths
    from remat.plan.offload_cost import offloadable_bytes

    from plan_toys import FINGERPRINT, replace

    big = 1 << 20
    ops = (op("aten.mm.default#0", big, big, 1.0), op("aten.relu.default#0", big, big, 1.0))
    blocks = [block(i, input_bytes=1 << 10, saved_bytes=2 * big, fwd_ms=2.0, bwd_ms=4.0, ops=ops) for i in range(3)]
    rates = Bandwidths(host_to_device_bytes_per_s=1e12, device_to_host_bytes_per_s=1e12, overlap_fraction=1.0)
    prof = profile(blocks, fingerprint=replace(FINGERPRINT, device="cuda"), bandwidths=rates)
    assert offloadable_bytes(prof.blocks[0]) == 2 * big
    keep_peak = predict(prof, plan(prof, strategy="none").segments).peak_bytes
    got = plan(prof, budget=keep_peak - big)
    assert "offload:cpu" in got.block_strategies()
    assert got.prediction.extra_ms == 0.0
    no_rates = replace(prof, bandwidths=Bandwidths())
    assert "offload:cpu" not in plan(no_rates, budget=keep_peak - big).block_strategies()


@pytest.mark.parametrize("seed", range(4))
def test_optimal_with_gradients_heavier_than_activations(seed):
    """Per-block gradients larger than what blocks hold: a segment can hold less than the
    gradients it has not produced yet (negative adjusted bytes in the DP)."""
    rng = random.Random(100 + seed)
    n = rng.randint(2, 5)
    blocks = [block(i, input_bytes=1, saved_bytes=rng.randint(1, 4), bwd_temp_bytes=rng.randint(0, 2),
                    fwd_ms=float(rng.randint(1, 5))) for i in range(n)]
    if seed % 2:  # alike blocks: the O(N^2) tables
        blocks = [block(i, input_bytes=1, saved_bytes=3, bwd_temp_bytes=1, fwd_ms=2.0) for i in range(n)]
    from plan_toys import replace

    blocks = [replace(b, grad_bytes=6) for b in blocks]
    prof = profile(blocks, param_bytes=6 * n + 5, grad_bytes=6 * n + 5, fixed_post_saved_bytes=2)
    _check_against_space(prof)


@pytest.mark.parametrize("seed", [0, 1])
def test_pareto_past_the_exact_search_ends_at_the_least_peak_and_beats_the_recipes(seed):
    """64 unlike blocks: the slot-counted search makes the frontier. Its last plan is the least
    peak `plan` finds, and no plan on it is slower than full recomputation or sqrt at a peak no
    lower than theirs."""
    prof = random_profile(random.Random(seed), 64)
    frontier = pareto(prof)
    least = plan(prof, budget=frontier[-1].prediction.peak_bytes)
    assert frontier[-1].prediction.peak_bytes == least.prediction.peak_bytes
    with pytest.raises(ValueError, match="minimum feasible peak"):
        plan(prof, budget=frontier[-1].prediction.peak_bytes - 1)
    for recipe in ("full", "sqrt"):
        r = plan(prof, strategy=recipe).prediction
        assert not any(p.prediction.peak_bytes >= r.peak_bytes and p.prediction.step_ms > r.step_ms + 1e-9
                       for p in frontier), recipe
    peaks = [p.prediction.peak_bytes for p in frontier]
    assert peaks == sorted(peaks, reverse=True)
