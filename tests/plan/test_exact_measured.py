"""The optimal planner against every layout of measured profiles whose blocks differ.

Five tiny real models are profiled here (``repeats=1``; `measured_models`): an MLP whose widths
vary (6 blocks), a ConvNet whose stages halve the image (5 blocks), the built-in GPT (3
blocks), adapters behind frozen projections (4 blocks, none saving its input: a replay's
first block and its later ones hold different bytes) and residual blocks that save a scaled
copy of their input (6 blocks: a nested child's input is held through its backward only where
the child begins its top-level segment; searched as always held, some budgets got a slower
plan than the best that fits). For every budget that matters (each enumerated layout's own peak, each point of the
time-memory frontier and 1 and 4096 bytes above it) the plan must fit by `predict` and no layout
of the space (`plan_space`: keep / selective / offload per block, nested recompute segments) that
fits may be predicted faster; below the least peak nothing is planned. Timings differ from run
to run; the property holds for any.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from remat.measure.types import Bandwidths
from remat.plan.planners import pareto, plan
from remat.plan.predict import baseline_step_ms, keep_peak_bytes, predict
from remat.plan.search import OptimalSearch, block_options
from remat.plan.types import Segment

from measured_models import adapter_model, adapter_profile, convnet_profile, gpt_profile, mlp_profile, scaled_profile
from plan_space import combine, element_tables, enumerate_space, layouts

pytestmark = pytest.mark.slow

TOLERANCE_MS = 1e-9
"""The DP adds the same times as `predict` in another order: equal up to float rounding."""


def _gated_profile():
    """Four layers whose first output the code holds to the end (`test_cached_escaping.Gated`): the
    exact tables count it through the backward too, a bound, and priced the least-peak layout (a
    nested segment, which drops it earlier) over another; the planner refused the budgets between."""
    import torch

    import remat
    from test_cached_escaping import B, D, S, Gated, _square

    torch.manual_seed(0)
    return remat.profile(Gated(), torch.randn(B, S, D), _square, repeats=1)


@pytest.fixture(scope="module")
def measured():
    return {
        "mlp": mlp_profile(6),
        "convnet": convnet_profile(5),
        "gpt": gpt_profile(num_layers=3, d_model=32, num_heads=2, seq_len=64, batch_size=4, vocab_size=64),
        "adapters": adapter_profile(4),
        "scaled": scaled_profile(6),
        "gated": _gated_profile(),
    }


@pytest.fixture(scope="module")
def spaces(measured):
    return {name: enumerate_space(profile) for name, profile in measured.items()}


def _budgets(space) -> list[int]:
    frontier = [peak for peak, _ in space.frontier()]
    return sorted(set(space.peaks.tolist()) | {p + d for p in frontier for d in (1, 4096)})


def _check_every_budget(profile, space, joins=None, claimed_exact=True) -> None:
    """The optimum at every budget; ``claimed_exact``: the search's bound says so too (else its
    lower bound holds: no layout that fits is faster than it)."""
    search = OptimalSearch(profile, joins=joins)
    baseline = baseline_step_ms(profile)
    for budget in _budgets(space):
        best = space.best_ms(budget)
        choice = search.choose(budget)
        prediction = predict(profile, choice.segments)
        assert prediction.peak_bytes <= budget
        assert prediction.step_ms <= best + TOLERANCE_MS, f"budget {budget}: {prediction.step_ms} ms > {best} ms"
        assert choice.optimality.quantum_bytes == 1
        assert choice.optimality.exact if claimed_exact else choice.optimality.lower_bound_ms <= best - baseline + TOLERANCE_MS
    floor = int(space.peaks.min())
    assert search.choose(floor - 1) is None


@pytest.mark.parametrize("name", ["mlp", "convnet", "gpt", "adapters", "scaled", "gated"])
def test_optimal_is_the_best_layout_at_every_budget(measured, spaces, name):
    profile, space = measured[name], spaces[name]
    assert len(space.frontier()) >= 3  # the budgets trade memory for time
    # gated: the relaxed tables' bound is below what fits at some budgets, so optimal, not proven so
    _check_every_budget(profile, space, claimed_exact=name != "gated")
    floor = int(space.peaks.min())
    assert plan(profile, budget=floor).prediction.peak_bytes == floor
    with pytest.raises(ValueError, match="minimum feasible peak"):
        plan(profile, budget=floor - 1)


@pytest.mark.parametrize("name", ["mlp", "convnet", "gpt", "adapters", "scaled"])
def test_pareto_is_the_enumerated_frontier(measured, spaces, name):
    profile, frontier = measured[name], spaces[name].frontier()
    got = [(p.prediction.peak_bytes, p.prediction.step_ms) for p in pareto(profile)][::-1]
    assert [peak for peak, _ in got] == [peak for peak, _ in frontier]
    assert [ms for _, ms in got] == pytest.approx([ms for _, ms in frontier], rel=0, abs=TOLERANCE_MS)


@pytest.mark.parametrize("name", ["convnet", "gpt"])
def test_optimal_with_a_fresh_memory_saving(measured, name):
    """As on a CPU where the step faults in fresh pages: a lower peak saves time too
    (`remat.plan.predict.fresh_memory`), so the fastest plan may hold less than it could."""
    profile = _faulting(measured[name])
    _check_every_budget(profile, enumerate_space(profile))


def _faulting(profile):
    """The profile with a third of its no-recomputation peak faulted in fresh each step."""
    return dataclasses.replace(profile, step_fault_bytes=keep_peak_bytes(profile) // 3, first_touch_ms_per_byte=3e-6)


def _with_rates(profile, device: str):
    rates = Bandwidths(host_to_device_bytes_per_s=2e9, device_to_host_bytes_per_s=2e9, overlap_fraction=0.5,
                       disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=1e9, disk_overlap_fraction=0.3)
    return dataclasses.replace(profile, fingerprint=dataclasses.replace(profile.fingerprint, device=device),
                               bandwidths=rates, step_fault_bytes=0)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_optimal_under_fsdp_where_a_segment_is_one_unit(measured, name):
    """ZeRO-3 over 2 ranks (`shard_profile`): a recompute segment of several blocks is one FSDP
    unit, its blocks' weights gathered together through its backward, and the units beside it,
    whose prefetched weights and reduce-scatter input it holds, priced as large
    (`remat.plan.phases.unit_extra_bytes`), so longer segments cost more than their held input.
    The search prices that per segment as `predict` does: still the best layout at every budget."""
    from remat.distributed import shard_profile
    from remat.plan.phases import unit_extra_bytes

    profile = shard_profile(measured[name], world_size=2, zero_stage=3)
    units = profile.unit_bytes
    block = units[0]
    assert profile.gathered_bytes == 3 * max(units) + measured[name].param_bytes - sum(units)
    assert unit_extra_bytes(profile, 0, 1) == 0
    # the MLP's widths vary: a two-block unit at the chain's start gathers both blocks beyond the
    # largest, and the unit after it (the reduce-scatter input it holds) is priced as large; one
    # inside the chain has a unit on either side (the one before it prefetched)
    assert unit_extra_bytes(profile, 0, 2) == 2 * max(0, units[0] + units[1] - max(units))
    inside = 3 if profile.num_blocks > 3 else 2
    assert unit_extra_bytes(profile, 1, 3) == inside * max(0, units[1] + units[2] - max(units))
    assert block > 0 and unit_extra_bytes(profile, 0, profile.num_blocks) > 0
    _check_every_budget(profile, enumerate_space(profile))


@pytest.mark.parametrize("name", ["convnet", "gpt"])
def test_optimal_with_offload_rates(measured, name):
    """The profile as taken on a GPU with measured host and disk rates: offload joins the space."""
    profile = _with_rates(measured[name], "cuda")
    assert {"offload:cpu", "offload:disk"} <= {s.strategy for s in block_options(profile, 0)}
    _check_every_budget(profile, enumerate_space(profile))


def test_offload_with_a_fresh_memory_saving_is_bounded(measured):
    """Offloaded bytes earn no fresh-memory saving, which the DP's curve does not record: the
    plan may miss the best, and its bound says so. It fits, lies in the space, and the bound is
    never above the best layout that fits."""
    profile = _faulting(_with_rates(measured["convnet"], "cpu"))
    space = enumerate_space(profile)
    search = OptimalSearch(profile)
    baseline = predict(profile, plan(profile, strategy="none").segments).step_ms
    for budget in _budgets(space):
        choice = search.choose(budget)
        prediction = predict(profile, choice.segments)
        best = space.best_ms(budget) - baseline
        assert prediction.peak_bytes <= budget
        assert choice.optimality.lower_bound_ms <= best + TOLERANCE_MS
        assert choice.optimality.extra_ms == pytest.approx(prediction.step_ms - baseline)
        assert choice.optimality.extra_ms >= best - TOLERANCE_MS


def test_adapter_layouts_measure_as_predicted(measured):
    """Blocks that do not save their input (`measured_models.AdapterBlock`): a segment's
    checkpoint holds the first block's input to the end of its replay, the later blocks' inputs
    go after their forwards. Each layout, nested ones included, measures what `predict` gives
    it (one replay forward, the (0, 3) segment's third block, is over by 1120 bytes, its
    forward term a bound), with identical gradients. Before, a replay's outputs were all held
    to its end, and the DP and `predict` counted the first block's input as freed: least-peak
    plans measured up to 18 % over (nested segments three deep)."""
    import remat

    model, batch = adapter_model(4)
    prof = measured["adapters"]
    assert [b.unsaved_input_bytes for b in prof.blocks] == [0, 64 * 32 * 4, 64 * 32 * 4, 64 * 32 * 4]
    base = plan(prof, strategy="none")
    r = lambda a, b, *children: Segment(start=a, stop=b, strategy="recompute", children=children)  # noqa: E731
    keep = lambda a: Segment(start=a, stop=a + 1, strategy="keep")  # noqa: E731
    over = {}
    for segments in [(r(0, 4),), (r(0, 3), keep(3)), (r(0, 4, r(0, 2)),), (r(0, 4, r(1, 3)),), (keep(0), r(1, 4, r(1, 2))),
                     (r(0, 4, r(0, 3, r(0, 2, r(0, 1)))),), (r(0, 1), r(1, 4))]:
        layout = dataclasses.replace(base, segments=segments, prediction=predict(prof, segments))
        check = remat.verify(model, batch, layout, repeats=1)
        assert check.ok and check.grads_identical, segments
        over[len(over)] = check.predicted_peak_bytes - check.measured_peak_bytes
    assert over == {0: 0, 1: 1120, 2: 0, 3: 0, 4: 0, 5: 0, 6: 0}
    least = pareto(prof)[-1]
    check = remat.verify(model, batch, plan(prof, budget=least.prediction.peak_bytes), repeats=1)
    assert check.ok and check.measured_peak_bytes <= least.prediction.peak_bytes


def test_the_oracle_combines_elements_as_predict_does(measured):
    """`plan_space.combine` against `predict` on 300 layouts drawn from the whole space."""
    profile = _faulting(_with_rates(measured["convnet"], "cpu"))
    every = list(layouts(element_tables(profile)))
    for elements in random.Random(0).sample(every, 300):
        prediction = predict(profile, tuple(e.segment for e in elements))
        peak, ms = combine(profile, elements)
        assert peak == prediction.peak_bytes
        assert math.isclose(ms, prediction.step_ms, rel_tol=0, abs_tol=TOLERANCE_MS)


@pytest.fixture(scope="module")
def gpt_small():
    """The issue's model: GPT small (4 layers, d_model 128, seq 64, batch 8, vocab 512), no optimizer."""
    return gpt_profile(num_layers=4, d_model=128, num_heads=4, seq_len=64, batch_size=8, vocab_size=512)


def test_gpt_small_beats_checkpoint_sequential_at_its_peak(gpt_small):
    """checkpoint_sequential's layout (blocks 0-1 one recomputed segment, 2 and 3 kept): at its
    own predicted peak, and 64 KiB above it, the plan is no slower (it used to recompute blocks
    0-2 one by one, 16 % slower)."""
    sequential = (Segment(start=0, stop=2, strategy="recompute"), Segment(start=2, stop=3, strategy="keep"),
                  Segment(start=3, stop=4, strategy="keep"))
    target = predict(gpt_small, sequential)
    for budget in (target.peak_bytes, target.peak_bytes + 64 * 1024):
        got = plan(gpt_small, budget=budget).prediction
        assert got.peak_bytes <= budget
        assert got.step_ms <= target.step_ms + TOLERANCE_MS


def test_gpt_small_at_each_layouts_own_peak(gpt_small):
    """Every keep / recompute / nested-segment layout of the 4 blocks (352): at its own peak the
    plan fits and is no slower than it (it used to be slower for 22 of them and refuse one)."""
    space = enumerate_space(gpt_small, options=False)
    assert space.peaks.size == 352
    search = OptimalSearch(gpt_small)
    for peak, ms in zip(space.peaks.tolist(), space.step_ms.tolist()):
        choice = search.choose(peak)
        got = predict(gpt_small, choice.segments)
        assert got.peak_bytes <= peak and got.step_ms <= ms + TOLERANCE_MS


def test_gpt_small_floor_and_whole_budget(gpt_small):
    """The least feasible peak (pareto's last plan), 4 KiB and 1 % above it are met by a plan
    that is the optimum (they used to be refused, or met 124 KiB above the floor); a budget
    that keeping everything fits recomputes nothing, as 100 % of a measured peak equal to it
    does (it used to recompute a block)."""
    frontier = pareto(gpt_small)
    floor = frontier[-1].prediction.peak_bytes
    for budget in (floor, floor + 4096, int(floor * 1.01)):
        got = plan(gpt_small, budget=budget)
        assert got.prediction.peak_bytes <= budget
        assert got.optimality.exact
    keep = plan(gpt_small, strategy="none").prediction
    whole = plan(gpt_small, budget=keep.peak_bytes)
    assert whole.block_strategies() == ("keep",) * 4 and whole.prediction.step_ms == keep.step_ms
    measured = dataclasses.replace(gpt_small, peak_bytes=keep.peak_bytes)
    assert plan(measured, budget="100%").block_strategies() == ("keep",) * 4


@pytest.mark.parametrize("as_view", [False, True])
def test_ddp_buckets_counted_beside_a_sharded_optimizer_too(measured, as_view):
    """Stage 1 (DDP with torch's ZeroRedundancyOptimizer) keeps DDP's gradient buckets as stage 0
    does; they were left out: DDP + ZeRO with bucket views measured 25 % over its prediction."""
    from remat.distributed import shard_profile

    whole = measured["gpt"]
    for stage in (0, 1):
        sharded = shard_profile(whole, world_size=2, zero_stage=stage, gradient_as_bucket_view=as_view)
        assert sharded.bucket_bytes == whole.grad_bytes
        assert sharded.grad_bytes == (0 if as_view else whole.grad_bytes)
    assert shard_profile(whole, world_size=2, zero_stage=2).bucket_bytes == 0
    assert shard_profile(whole, world_size=1, zero_stage=1).bucket_bytes == 0
