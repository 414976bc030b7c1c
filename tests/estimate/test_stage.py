"""A stage's peak and time, and the optimal per-layer mix, on hand-made layers."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest

from remat.estimate.comms import ModelFacts, Network
from remat.estimate.layers import LayerOnGpu, layer_cost
from remat.estimate.optimal import cheapest_mix
from remat.estimate.parallel import Parallelism
from remat.estimate.stage import Rates, Stage, stage_peak, stage_time
from remat.estimate.strategies import choose, option_seconds
from remat.memory.model_state import ModelState

LAYER = LayerOnGpu(saved_bytes=100.0, core_bytes=40.0, input_bytes=10.0, working_bytes=130.0, replay_working_bytes=140.0,
                   fwd_flops=1e6, bwd_flops=2e6, core_flops=2e5, core_moved_bytes=1000.0, expert_flops=0.0, hidden_bytes=10.0)
STATE = ModelState(param_bytes=1000, grad_bytes=1000, master_bytes=0, optimizer_state_bytes=2000)
RATES = Rates(flops_per_s=1e9, memory_bytes_per_s=1e6, host_link_bytes_per_s=1e4)
NET = Network(intra_node_bytes_per_s=1e3, inter_node_bytes_per_s=1e2, gpus_per_node=8)


def _stage(n: int = 3, *, in_flight: float = 1.0, first: bool = True, last: bool = True) -> Stage:
    return Stage(index=0, first=first, last=last, state=STATE, layers=(LAYER,) * n, pre_bytes=7.0,
                 post_saved_bytes=50.0 if last else 0.0, post_working_bytes=20.0 if last else 0.0, post_flops=3e5, post_bwd_flops=6e5,
                 in_flight=in_flight, buffer_bytes=0.0)


def test_peak_by_hand() -> None:
    """Keep everything: the head's moment holds state 4000 + pre 7 + 3 x 100 + head 50 + 20 = 4377;
    the last layer's backward 4000 + 7 + 200 + 130 = 4337. Full: head 4000 + 7 + 30 + 70 = 4107,
    layer 4000 + 7 + 20 + 140 = 4167 (its replay's working set sets the peak)."""
    none = stage_peak(_stage(), [layer_cost(LAYER, "none")] * 3)
    assert (none.peak_bytes, none.phase, none.held_bytes, none.working_bytes) == (4377.0, "head", 307.0, 70.0)
    full = stage_peak(_stage(), [layer_cost(LAYER, "full")] * 3)
    assert (full.peak_bytes, full.phase) == (4167.0, "layers")
    # a pipeline's first stage holds 4 micro-batches: 4 x (7 + 300) - 100 + 130
    first = stage_peak(_stage(in_flight=4.0, last=False), [layer_cost(LAYER, "none")] * 3)
    assert first.peak_bytes == 4000 + 4 * 307 - 100 + 130


def test_the_part_before_the_layers_has_a_forward_and_a_backward_moment() -> None:
    """TAPAS's embeddings peak in their forward (cell positions over the table), ConvBERT's in their
    backward: the first stage prices both. Forward, every gradient live (several micro-batches):
    state 4000 + pre forward peak 900 = 4900. With 4 micro-batches in flight, the 3 before it hold
    3 x (7 + 300): 4000 + 921 + 900. Backward, after every layer's, with the gradients made as
    the backward goes (one per layer of 100, the pre part's 300): state less gradients 3000 + the
    700 made + pre 7 + its working 800 = 4507."""
    flat = replace(_stage(), pre_forward_peak_bytes=900.0)
    assert (stage_peak(flat, [layer_cost(LAYER, "full")] * 3).peak_bytes, stage_peak(
        flat, [layer_cost(LAYER, "full")] * 3).phase) == (4900.0, "pre-forward")
    deep = replace(flat, in_flight=4.0, last=False)
    assert stage_peak(deep, [layer_cost(LAYER, "none")] * 3).peak_bytes == 4000 + 3 * 307 + 900
    grads = replace(_stage(), pre_working_bytes=800.0, layer_grad_bytes=(100.0,) * 3, pre_grad_bytes=300.0)
    back = stage_peak(grads, [layer_cost(LAYER, "full")] * 3)
    assert (back.peak_bytes, back.phase, back.held_bytes, back.working_bytes) == (4507.0, "pre-backward", 7.0, 800.0)
    # without them (a causal LM's embeddings: nothing beyond what they save) no such moment is priced
    assert stage_peak(_stage(), [layer_cost(LAYER, "full")] * 3).phase == "layers"


def test_time_by_hand() -> None:
    """Forward 3e6 + head 3e5 FLOPs at 1e9 FLOP/s, x3 for forward and backward; selective adds the
    core: max(2e5 FLOPs at 1e9, 1000 bytes at 1e6 B/s) = 1 ms per layer."""
    par = Parallelism()
    none = stage_time(_stage(), [layer_cost(LAYER, "none")] * 3, RATES, par=par, net=NET, facts=ModelFacts())
    assert none.compute_s == pytest.approx(3 * 3.3e6 / 1e9) and none.comm_s == 0.0
    selective = stage_time(_stage(), [layer_cost(LAYER, "selective")] * 3, RATES, par=par, net=NET, facts=ModelFacts())
    assert selective.compute_s == pytest.approx(none.compute_s + 3 * 1e-3)
    # tensor parallel 2: 4 all-reduces of the hidden states per layer, 6 for a replayed forward
    tp = stage_time(_stage(), [layer_cost(LAYER, "full")] * 3, RATES, par=Parallelism(tensor=2), net=NET, facts=ModelFacts())
    assert tp.comm_s == pytest.approx(3 * 6 * (2 * 1 / 2 * 10.0 / 1e3))


def test_a_forward_that_makes_more_than_it_keeps_peaks_in_the_forward() -> None:
    """Three layers keeping 100 bytes each whose forward needs 1500 on top of what is live (LoRA's
    dropout makes the adapters' inputs there): the last layer's forward holds the state less its
    gradients, none made yet (4000 - 1000), pre 7, the two layers before 200 and its own 1500: 4707,
    above its backward's 3000 + 1000 gradients + 7 + 200 + 130 = 4337. Recomputed, a layer's forward
    keeps its input alone: 1500 - 100 + 10."""
    layer = replace(LAYER, forward_working_bytes=1500.0)
    stage = replace(_stage(), layers=(layer,) * 3, layer_grad_bytes=(0.0, 0.0, 0.0))
    peak = stage_peak(stage, [layer_cost(layer, "none")] * 3)
    assert (peak.phase, peak.peak_bytes) == ("forward", 4000 - 1000 + 7 + 200 + 1500)
    assert layer_cost(layer, "full").forward_bytes == 1410.0
    assert stage_peak(stage, [layer_cost(LAYER, "none")] * 3).peak_bytes == 4337  # without: the backward's


def test_frozen_and_quantized_layers_by_hand() -> None:
    """A frozen linear's layer under LoRA runs one backward product where a trained one runs two:
    backward 1e6 FLOPs, not 2e6. NF4 base weights (1000 bytes dequantized a pass, at 1e6 B/s) add
    1 ms in the forward and 1 ms in the backward, and 1 ms more when the layer is replayed."""
    par, lora = Parallelism(), replace(LAYER, bwd_flops=1e6)
    plain = stage_time(_stage(), [layer_cost(LAYER, "none")] * 3, RATES, par=par, net=NET, facts=ModelFacts())
    frozen = stage_time(replace(_stage(), layers=(lora,) * 3), [layer_cost(lora, "none")] * 3, RATES, par=par,
                        net=NET, facts=ModelFacts())
    assert plain.compute_s - frozen.compute_s == pytest.approx(3 * 1e6 / 1e9)
    assert plain.backward_s - frozen.backward_s == pytest.approx(3 * 1e6 / 1e9)
    nf4 = replace(lora, dequant_bytes=1000.0)
    for strategy, passes in (("none", 2), ("full", 3)):
        base = stage_time(replace(_stage(), layers=(lora,) * 3), [layer_cost(lora, strategy)] * 3, RATES, par=par,
                          net=NET, facts=ModelFacts())
        quantized = stage_time(replace(_stage(), layers=(nf4,) * 3), [layer_cost(nf4, strategy)] * 3, RATES, par=par,
                               net=NET, facts=ModelFacts())
        assert quantized.compute_s - base.compute_s == pytest.approx(3 * passes * 1e-3)
        assert quantized.backward_s - base.backward_s == pytest.approx(3 * (passes - 1) * 1e-3)


def _brute(stage: Stage, budget: float, names=("none", "selective", "full", "offload")):
    best = None
    for combo in itertools.product(names, repeat=len(stage.layers)):
        costs = [layer_cost(x, n) for x, n in zip(stage.layers, combo)]
        costs = sorted(costs, key=lambda c: c.retained_bytes)  # identical layers: holding the most last
        if stage_peak(stage, costs).peak_bytes > budget:
            continue
        seconds = sum(option_seconds(x, c, RATES, Parallelism(), NET) for x, c in zip(stage.layers, costs))
        if best is None or seconds < best:
            best = seconds
    return best


@pytest.mark.parametrize("budget", [4100.0, 4150.0, 4200.0, 4260.0, 4330.0, 4400.0])
def test_optimal_mix_equals_enumeration(budget: float) -> None:
    """The knapsack's mix is as fast as the best of all 4^4 assignments that fit, at budgets from
    where only offloading every layer fits to where keeping everything does."""
    stage = _stage(4)
    choice = choose(stage, "optimal", budget, rates=RATES, par=Parallelism(), net=NET)
    expected = _brute(stage, budget)
    if expected is None:
        assert choice.label.startswith("lowest peak")
        return
    assert stage_peak(stage, choice.costs).peak_bytes <= budget
    seconds = sum(option_seconds(x, c, RATES, Parallelism(), NET) for x, c in zip(stage.layers, choice.costs))
    assert seconds == pytest.approx(expected)


def test_optimal_labels_and_nothing_fits() -> None:
    stage = _stage(4)
    assert choose(stage, "optimal", 1e9, rates=RATES, par=Parallelism(), net=NET).label == "optimal: 4 none"
    lowest = choose(stage, "optimal", 10.0, rates=RATES, par=Parallelism(), net=NET)
    assert lowest.label == "lowest peak: 4 offload"
    no_host = Rates(flops_per_s=1e9)
    assert "offload" not in choose(stage, "optimal", 10.0, rates=no_host, par=Parallelism(), net=NET).label
    assert cheapest_mix(stage, [[layer_cost(LAYER, "none")]] * 4, [[0.0]] * 4, 10.0) is None
    with pytest.raises(ValueError, match="unknown strategy 'sqrt'; allowed: none, full, selective, optimal"):
        choose(stage, "sqrt", 1.0, rates=RATES, par=Parallelism(), net=NET)


WIDE = LayerOnGpu(saved_bytes=300.0, core_bytes=200.0, input_bytes=30.0, working_bytes=360.0, replay_working_bytes=330.0,
                  fwd_flops=3e6, bwd_flops=6e6, core_flops=1e5, core_moved_bytes=500.0, expert_flops=0.0, hidden_bytes=30.0)
"""A layer of another stack: an image tower's, retaining three times a text layer's."""
NAMES = ("none", "selective", "full", "offload")


def _towers(order: str, *, in_flight: float = 1.0, grads: bool = False) -> Stage:
    """Five layers of two kinds in ``order`` (``w``: `WIDE`, ``t``: `LAYER`), gradients made as
    the backward goes (``grads``) or live the whole step."""
    layers = tuple(WIDE if c == "w" else LAYER for c in order)
    extra = dict(layer_grad_bytes=tuple(180.0 if x is WIDE else 60.0 for x in layers), pre_grad_bytes=100.0) if grads else {}
    state = ModelState(param_bytes=1000, grad_bytes=int(100 + sum(extra.get("layer_grad_bytes", (0.0,)))) if grads else 1000,
                       master_bytes=0, optimizer_state_bytes=2000)
    return Stage(index=0, first=True, last=True, state=state, layers=layers, pre_bytes=7.0, post_saved_bytes=50.0,
                 post_working_bytes=20.0, post_flops=3e5, post_bwd_flops=6e5, in_flight=in_flight, buffer_bytes=0.0, **extra)


def _every_assignment(stage: Stage) -> list[tuple[float, float]]:
    """(peak, seconds) of each of the 4^5 assignments in forward order, none reordered."""
    out = []
    for combo in itertools.product(NAMES, repeat=len(stage.layers)):
        costs = [layer_cost(x, n) for x, n in zip(stage.layers, combo)]
        seconds = sum(option_seconds(x, c, RATES, Parallelism(), NET) for x, c in zip(stage.layers, costs))
        out.append((stage_peak(stage, costs).peak_bytes, seconds))
    return out


def _chosen(stage: Stage, budget: float):
    choice = choose(stage, "optimal", budget, rates=RATES, par=Parallelism(), net=NET)
    seconds = sum(option_seconds(x, c, RATES, Parallelism(), NET) for x, c in zip(stage.layers, choice.costs))
    return choice, stage_peak(stage, choice.costs).peak_bytes, seconds


@pytest.mark.parametrize("order", ["wwttt", "tttww", "twtwt"])
@pytest.mark.parametrize("grads", [False, True])
def test_optimal_on_two_stacks_equals_every_assignment(order: str, grads: bool) -> None:
    """Layers of two stacks (two towers; an encoder and a decoder) retain and work with different
    bytes, and with gradients made as the backward goes each layer's moment has its own gradients
    live. At every assignment's own peak and one byte under it, the mix chosen fits and is exactly
    as fast as the fastest of the 4^5 assignments in forward order that fit: one micro-batch in
    flight, sizes of whole bytes, so the table's slots are bytes and nothing is rounded."""
    stage = _towers(order, grads=grads)
    every = _every_assignment(stage)
    for budget in sorted({peak + d for peak, _ in every for d in (0.0, -1.0)}):
        fastest = min((s for p, s in every if p <= budget), default=None)
        choice, peak, seconds = _chosen(stage, budget)
        if fastest is None:
            assert choice.label.startswith("lowest peak"), budget
            continue
        assert peak <= budget and seconds == pytest.approx(fastest, rel=1e-12), (budget, choice.label)


def test_the_wide_tower_first_is_not_limited_to_what_the_last_layer_retains() -> None:
    """Two wide layers then three text layers, room for everything but one wide layer's
    selective savings: the fastest mix keeps the text layers and both wide layers but for the
    attention core of one (selective: 100 of 300 retained). Taking the last layer (a text layer,
    100 bytes kept) as the one holding the most would allow a wide layer no more than 100 bytes:
    both recomputed in full."""
    stage = _towers("wwttt")
    keep = [layer_cost(x, "none") for x in stage.layers]
    one_selective = [layer_cost(WIDE, "selective")] + keep[1:]
    budget = stage_peak(stage, one_selective).peak_bytes
    assert stage_peak(stage, keep).peak_bytes > budget
    choice, peak, _ = _chosen(stage, budget)
    assert choice.label == "optimal: 4 none, 1 selective" and peak <= budget


@pytest.mark.parametrize("order", ["wwttt", "tttww"])
@pytest.mark.parametrize("in_flight", [2.0, 3.5])
def test_optimal_with_micro_batches_in_flight_within_its_bound(order: str, in_flight: float) -> None:
    """With several micro-batches in flight the retained bytes ``R`` of every layer enter each
    layer's moment (``(n - 1) R``), held by targets: at every assignment's own peak the mix chosen
    fits and is never slower than the fastest assignment fitting ``bound_bytes`` under the budget.
    Here it is as fast as the fastest fitting the budget itself at every one of them (108 to 195
    budgets a case): each slot's prefix carries the least room it left, so an entry counts by its
    own ``R``, not its row's target."""
    from remat.estimate.optimal import bound_bytes

    stage = _towers(order, in_flight=in_flight)
    every = _every_assignment(stage)
    options = [[layer_cost(x, n) for n in NAMES] for x in stage.layers]
    for budget in sorted({peak for peak, _ in every}):
        fastest = min(s for p, s in every if p <= budget)
        choice, peak, seconds = _chosen(stage, budget)
        slack = bound_bytes(stage, options, budget)
        within = min((s for p, s in every if p <= budget - slack), default=math.inf)
        assert peak <= budget and seconds <= within + 1e-15, (budget, choice.label)
        assert seconds == pytest.approx(fastest, rel=1e-12), (budget, choice.label)


@pytest.mark.parametrize("in_flight", [1.0, 3.5])
def test_a_coarse_table_keeps_its_bound(monkeypatch, in_flight: float) -> None:
    """With 16 slots and 2 targets (sizes rounded to tens of bytes, the grid of targets half the
    retained bytes apart) the mix chosen still fits every budget, and no assignment fitting
    ``bound_bytes`` under it is faster: the bound a long stack's table keeps at its real sizes."""
    from remat.estimate import optimal

    monkeypatch.setattr(optimal, "SLOTS", 16)
    monkeypatch.setattr(optimal, "PIPELINE_SLOTS", 16)
    monkeypatch.setattr(optimal, "TARGETS", 2)
    stage = _towers("wwttt", in_flight=in_flight)
    every = _every_assignment(stage)
    options = [[layer_cost(x, n) for n in NAMES] for x in stage.layers]
    rounded = 0
    for budget in sorted({peak for peak, _ in every}):
        choice, peak, seconds = _chosen(stage, budget)
        slack = optimal.bound_bytes(stage, options, budget)
        within = min((s for p, s in every if p <= budget - slack), default=math.inf)
        assert peak <= budget and min(s for p, s in every if p <= budget) - 1e-15 <= seconds <= within + 1e-15
        rounded += slack > 100.0
    assert rounded > 0  # the slots are coarse here: the bound is more than a layer's bytes
