"""Uneven pipeline splits: the first and last stages' layers given (Megatron-LM's
``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``), the rest even
over the stages between, on hand counts and a small GPT of 7 layers traced on the meta device."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from remat.cli import app
from remat.estimate import DeviceSpec, ModelSource, Parallelism, SearchSpace
from remat.estimate.fastest import layouts
from remat.estimate.fastest import search as search_traced
from remat.estimate.parallel import uneven_hint, uneven_split
from remat.estimate.pricing import Pricing
from remat.estimate.sharding import StateRecipe, check_layers, stage_layers
from remat.estimate.stage import stage_time
from remat.estimate.strategies import STRATEGY_NAMES
from remat.estimate.trace import trace_source
from remat.memory.allowance import NO_ALLOWANCE

SEQ = 16
DEVICE = DeviceSpec(name="Toy", memory_bytes=2**30, peak_bf16_flops_per_s=1e12, memory_bytes_per_s=1e11,
                    host_link_bytes_per_s=1e10, gpu_link_bytes_per_s=1e11, gpus_per_node=4)
RECIPE = StateRecipe(optimizer="adamw", precision="mixed", zero_stage=1)


def _gpt(layers: int) -> ModelSource:
    return ModelSource(builtin="gpt", sizes=dict(num_layers=layers, d_model=32, num_heads=2, vocab_size=64))


@pytest.fixture(scope="module")
def seven():
    return trace_source(_gpt(7), seq_len=SEQ)


@pytest.fixture(scope="module")
def eight():
    return trace_source(_gpt(8), seq_len=SEQ)


def _pricing(traced, par: Parallelism, micro_batches: int = 8) -> Pricing:
    return Pricing(traced=traced, micro_batch=2, micro_batches=micro_batches, recipe=RECIPE, parallelism=par, mfu=0.5,
                   allowance=NO_ALLOWANCE, strategies=STRATEGY_NAMES)


def test_stage_sizes_by_hand() -> None:
    """Llama 3 405B's 126 layers over 16 stages: 7 on the first and the last, 8 on the 14 between;
    DeepSeek-V3's 61 over 16: 3 and 2, 4 between. One end given: the others share the rest."""
    assert Parallelism(pipeline=16, first_stage_layers=7, last_stage_layers=7).stage_sizes(126) == (7,) + (8,) * 14 + (7,)
    assert Parallelism(pipeline=16, first_stage_layers=3, last_stage_layers=2).stage_sizes(61) == (3,) + (4,) * 14 + (2,)
    assert Parallelism(pipeline=4, first_stage_layers=1).stage_sizes(10) == (1, 3, 3, 3)
    assert Parallelism(pipeline=4, last_stage_layers=4).stage_sizes(10) == (2, 2, 2, 4)
    assert Parallelism(pipeline=2, first_stage_layers=4, last_stage_layers=3).stage_sizes(7) == (4, 3)
    assert Parallelism(pipeline=4).stage_sizes(8) == (2, 2, 2, 2)
    par = Parallelism(pipeline=3, first_stage_layers=1, last_stage_layers=2)
    assert [list(stage_layers(7, par, k)) for k in range(3)] == [[0], [1, 2, 3, 4], [5, 6]]
    assert uneven_split(126, 16) == (7, 7) and uneven_split(61, 16) == (3, 2) and uneven_split(7, 2) == (4, 3)
    assert uneven_split(64, 16) is None and uneven_split(5, 4) is None  # even; 2 + 2 between leave 1 for two ends
    assert uneven_hint(126, 16) == "--first-stage-layers 7 --last-stage-layers 7 (7 + 7 layers, 8 on each of the 14 between)"


def test_micro_batches_in_flight_per_stage() -> None:
    """1F1B: stage k holds min(m, p - k) micro-batches (Korthikanti et al. 2022, section 4.2.3).
    Interleaved, v = 2 chunks a stage, p = 4, m = 8: stage k runs 2 (4 - k - 1) + 4 chunk forwards
    before its first backward and one more, 11, 9, 7 and 5 halves of its layers (the first's 5.5 is
    Megatron-LM's p (1 + (p - 1)/(p v))); with m = p = 4 every forward runs first: 4 on each."""
    par = Parallelism(pipeline=4)
    assert [par.in_flight_at(k, 8) for k in range(4)] == [4.0, 3.0, 2.0, 1.0]
    assert [par.in_flight_at(k, 2) for k in range(4)] == [2.0, 2.0, 2.0, 1.0]
    interleaved = Parallelism(pipeline=4, virtual_stages=2)
    assert [interleaved.in_flight_at(k, 8) for k in range(4)] == [5.5, 4.5, 3.5, 2.5]
    assert interleaved.in_flight(8) == 4 * (1 + 3 / 8)
    assert [interleaved.in_flight_at(k, 4) for k in range(4)] == [4.0] * 4


def test_bad_splits_are_refused_with_one_that_works() -> None:
    with pytest.raises(ValueError, match=r"126 layers do not split evenly over 16 pipeline stage\(s\) x 1 chunk\(s\) = 16; "
                                         r".* or give the first and last stages their own: --first-stage-layers 7 "
                                         r"--last-stage-layers 7 \(7 \+ 7 layers, 8 on each of the 14 between\)\."):
        check_layers(126, Parallelism(pipeline=16))
    with pytest.raises(ValueError, match=r"10 layers over 4 pipeline stages with 2 on the first stage: the other 8 do "
                                         r"not split evenly over the 3 stage\(s\) left; for example --first-stage-layers 2 "
                                         r"--last-stage-layers 2"):
        check_layers(10, Parallelism(pipeline=4, first_stage_layers=2))
    with pytest.raises(ValueError, match="the other 0 do not split evenly over the 1 stage"):
        check_layers(8, Parallelism(pipeline=3, first_stage_layers=4, last_stage_layers=4))
    with pytest.raises(ValueError, match="first_stage_layers must be an integer >= 1 or None"):
        Parallelism(pipeline=2, first_stage_layers=0)
    with pytest.raises(ValueError, match="needs pipeline parallelism above 1; pass --pipeline-parallel P with P > 1 or "
                                         "drop --last-stage-layers"):
        Parallelism(last_stage_layers=3)
    with pytest.raises(ValueError, match=r"7 layers as 3/4 a stage over 2 chunks each: every stage's layers must split "
                                         r"into the 2 chunks of the interleaved schedule; pick --first-stage-layers and "
                                         r"--last-stage-layers that 2 divides, or drop --virtual-stages\."):
        check_layers(7, Parallelism(pipeline=2, virtual_stages=2, first_stage_layers=3))
    assert Parallelism(pipeline=3, virtual_stages=2, first_stage_layers=2, last_stage_layers=2).stage_sizes(8) == (2, 4, 2)


def test_an_uneven_split_equal_to_the_even_one_prices_the_same(eight) -> None:
    """8 layers over 4 stages given as 2 first and 2 last: the same stages as the even split, and
    the second stage priced beside them (2 layers, 3 micro-batches in flight) peaks below the
    first, so every strategy's peak, step and label are the same."""
    even = _pricing(eight, Parallelism(pipeline=4))
    given = _pricing(eight, Parallelism(pipeline=4, first_stage_layers=2, last_stage_layers=2))
    assert even.stage_indices() == (0, 3) and given.stage_indices() == (0, 1, 3)
    for name in STRATEGY_NAMES:
        a, b = even.price(DEVICE, name, 2, DEVICE.memory_bytes), given.price(DEVICE, name, 2, DEVICE.memory_bytes)
        assert b.stages[0] == a.stages[0] and b.stages[2] == a.stages[1]
        assert max(p.peak_bytes for p in b.peaks) == max(p.peak_bytes for p in a.peaks)
        assert b.time == a.time and [c.label for c in b.choices[::2]] == [c.label for c in a.choices]
        assert b.peaks[1].peak_bytes < b.peaks[0].peak_bytes


def test_the_stage_between_holds_its_layers_and_micro_batches(seven, eight) -> None:
    """7 layers as 1 + 4 + 2 over 3 stages, 8 micro-batches: the second stage runs 4 layers with
    2 micro-batches in flight, neither the embedding nor the head; its model state is that of 4
    layers, as the even 8-layer model's 2-layer stage's is 2 layers'. It holds 4 layers x 2
    micro-batches against the first's 1 x 3: its peak is the highest, and it is the slowest."""
    par = Parallelism(pipeline=3, first_stage_layers=1, last_stage_layers=2)
    pricing = _pricing(seven, par)
    first, between, last = pricing.stages(2)
    assert (len(first.layers), len(between.layers), len(last.layers)) == (1, 4, 2)
    assert (first.in_flight, between.in_flight, last.in_flight) == (3.0, 2.0, 1.0)
    assert (between.first, between.last, between.pre_bytes, between.post_saved_bytes) == (False, False, 0.0, 0.0)
    layer = between.layers[0]
    assert all(x == layer for x in between.layers)
    even = _pricing(eight, Parallelism(pipeline=4)).state(1)  # a stage of two layers, nothing else
    assert pricing.state(1).param_bytes == 2 * even.param_bytes
    assert pricing.state(1).optimizer_state_bytes == 2 * even.optimizer_state_bytes
    none = pricing.price(DEVICE, "none", 2, DEVICE.memory_bytes)
    assert max(range(3), key=lambda k: none.peaks[k].peak_bytes) == 1
    # its last layer's backward, the first of the stage: 2 micro-batches x 4 layers held but the
    # one whose backward runs, with all of its gradients (several micro-batches), its working set
    # and the send and receive buffers on top
    assert none.peaks[1].peak_bytes == (pricing.state(1).total_bytes + 7 * layer.saved_bytes + layer.working_bytes
                                        + between.buffer_bytes)
    net = pricing.network(DEVICE)
    times = [stage_time(s, c.costs, pricing.rates(DEVICE), par=par, net=net, facts=seven.facts)
             for s, c in zip(none.stages, none.choices)]
    assert max(range(3), key=lambda k: times[k].total_s) == 1
    assert none.time.compute_s == pytest.approx(8 * times[1].compute_s, rel=1e-12)


def test_search_tries_uneven_splits(seven) -> None:
    """7 layers on 2 GPUs: pipeline 2 splits them 4 + 3 or 3 + 4 (pipeline 7, one layer each,
    needs 7 GPUs). 4 + 3 is the faster: the last stage runs the head and the loss besides its layers."""
    space = SearchSpace(gpus=2, global_batch=8, seq_len=SEQ, tensor=(1,), context=(1,), micro_batch=(1,))
    found = {(par.pipeline, par.first_stage_layers, par.last_stage_layers) for par, _, _ in layouts(space, seven, 8)}
    assert found == {(1, None, None), (2, 4, 3), (2, 3, 4)}
    best = search_traced(seven, DEVICE, space, recipe=RECIPE, mfu=0.5, allowance=NO_ALLOWANCE, top=10)
    steps = {c.parallelism.describe(): c.step_s for c in best if c.zero_stage == 1}
    assert set(steps) == {"dp2", "dp1 pp2 (first 4, last 3)", "dp1 pp2 (first 3, last 4)"}
    assert steps["dp1 pp2 (first 4, last 3)"] < steps["dp1 pp2 (first 3, last 4)"]


def test_command_line() -> None:
    runner = CliRunner()
    args = ["estimate", "--model", "gpt", "--layers", "7", "--hidden", "32", "--heads", "2", "--vocab", "64",
            "--seq", str(SEQ), "--micro-batch", "2", "--grad-accum", "8", "--pp", "3", "--json"]
    refused = runner.invoke(app, args)
    assert refused.exit_code != 0
    assert "--first-stage-layers 2 --last-stage-layers 2 (2 + 2 layers, 3 on the stage between)" in " ".join(
        refused.output.split())
    ok = runner.invoke(app, [*args, "--first-stage-layers", "1", "--last-stage-layers", "2"])
    assert ok.exit_code == 0, ok.output
    assert '"first_stage_layers": 1' in ok.output and '"last_stage_layers": 2' in ok.output
    assert '"peak_stage": 1' in ok.output


def test_the_interleaved_last_stage_holds_its_warm_up(eight) -> None:
    """8 layers on 4 stages of 2 chunks, 8 micro-batches: the last stage runs 4 chunk forwards
    (half its layers each) before its first backward and one more, 2.5 micro-batches of its layers,
    where it was priced at one."""
    pricing = _pricing(eight, Parallelism(pipeline=4, virtual_stages=2))
    first, last = pricing.stages(2)
    assert (first.in_flight, last.in_flight) == (5.5, 2.5)
    one = _pricing(eight, Parallelism(pipeline=4)).stages(2)[-1]
    assert one.in_flight == 1.0 and last.layers == one.layers and last.post_saved_bytes == one.post_saved_bytes
    interleaved = pricing.price(DEVICE, "none", 2, DEVICE.memory_bytes)
    plain = _pricing(eight, Parallelism(pipeline=4)).price(DEVICE, "none", 2, DEVICE.memory_bytes)
    r = interleaved.choices[-1].costs[-1].retained_bytes
    w = interleaved.choices[-1].costs[-1].working_bytes
    state = pricing.state(3).total_bytes  # every gradient live: several micro-batches
    # its last layer's backward: 1 (1F1B) or 2.5 (interleaved) x 2 layers held but its own, its
    # working set and the send and receive buffers on top
    assert (plain.peaks[-1].phase, plain.peaks[-1].peak_bytes) == (
        "layers", pytest.approx(state + 2 * r - r + w + last.buffer_bytes, rel=1e-12))
    assert (interleaved.peaks[-1].phase, interleaved.peaks[-1].peak_bytes) == (
        "layers", pytest.approx(state + 2.5 * 2 * r - r + w + last.buffer_bytes, rel=1e-12))


def test_search_refuses_a_layout_it_would_ignore() -> None:
    """`--search` picks the layout; a layout given beside it was silently dropped."""
    runner = CliRunner()
    out = runner.invoke(app, ["estimate", "--model", "gpt", "--layers", "7", "--hidden", "32", "--heads", "2",
                              "--vocab", "64", "--seq", str(SEQ), "--search", "--gpus", "2", "--global-batch", "8",
                              "--pp", "2", "--first-stage-layers", "4"])
    assert out.exit_code != 0
    assert ("--search chooses the layout itself (data, tensor, pipeline, context and expert parallel sizes, the stages' "
            "layers, the micro-batch and the micro-batches per step); --pipeline-parallel, --first-stage-layers would be "
            "ignored. Drop them to search, or drop --search to estimate that layout.") in " ".join(out.output.split())
    sized = runner.invoke(app, ["estimate", "--model", "gpt", "--layers", "7", "--hidden", "32", "--heads", "2",
                                "--vocab", "64", "--seq", str(SEQ), "--search", "--gpus", "2", "--micro-batch", "4"])
    assert sized.exit_code == 2 and "--micro-batch would be ignored" in " ".join(sized.output.split())


def test_the_search_options_are_refused_without_search() -> None:
    """``--global-batch``, ``--gpus`` and ``--top`` without ``--search`` were dropped without a word:
    the estimate priced one micro-batch per step whatever global batch was asked for."""
    runner = CliRunner()
    base = ["estimate", "--model", "gpt", "--layers", "2", "--hidden", "32", "--heads", "2", "--vocab", "64",
            "--seq", str(SEQ)]
    out = runner.invoke(app, [*base, "--global-batch", "10", "--world-size", "4", "--micro-batch", "3"])
    assert out.exit_code == 2
    assert ("error: --global-batch is for --search, which lists the fastest layouts of --gpus GPUs; this estimate "
            "prices one layout, whose sequences per step are --world-size x --micro-batch x --grad-accum. Add "
            "--search, or drop --global-batch.") in " ".join(out.output.split())
    both = runner.invoke(app, [*base, "--gpus", "8", "--top", "3"])
    assert both.exit_code == 2 and "--gpus, --top are for --search" in " ".join(both.output.split())
