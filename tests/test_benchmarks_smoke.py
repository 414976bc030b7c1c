"""The peers benchmark keeps working: its pieces on toy inputs, and one tiny end-to-end run."""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

# benchmarks/ lives at the repository root, outside the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._peers import results, strategies  # noqa: E402
from benchmarks._peers.results import Row  # noqa: E402
from benchmarks._peers.runner import Runner, compare_grads, warm_up  # noqa: E402
from benchmarks._peers.tracking import allocator_peak_bytes  # noqa: E402
from benchmarks._peers.workloads import Workload, block_list  # noqa: E402

TINY = Workload(model="gpt", size="tiny")


def _runner(peer: strategies.Peer, workload: Workload = TINY) -> Runner:
    built = workload.build()
    params = list(built.model.parameters())
    module = peer.prepare(built.model, built.batch)
    runner = Runner(name=peer.name, mode=peer.mode, source="peer", module=module, params=params,
                    batch=built.batch, loss_fn=built.loss_fn)
    warm_up(runner, 1)
    return runner


@pytest.mark.parametrize("num_blocks, segments", [(1, 1), (4, 2), (6, 2), (9, 3), (12, 3), (144, 12)])
def test_sqrt_segments_rounds_the_square_root(num_blocks: int, segments: int) -> None:
    assert strategies.sqrt_segments(num_blocks) == segments


def test_titan_policy_saves_every_other_matmul_and_attention() -> None:
    class Ctx:
        is_recompute = False

    policy = strategies.titan_policy(defaultdict(int))
    mm, addmm, relu = torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.relu.default
    decisions = [policy(Ctx(), op) for op in (addmm, relu, mm, addmm, mm)]
    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert decisions == [save, recompute, recompute, save, recompute]
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert policy(Ctx(), sdpa) == save


def test_block_list_is_the_longest_module_list() -> None:
    model = TINY.build().model
    parent, attr, blocks = block_list(model)
    assert (parent is model, attr, len(blocks)) == (True, "blocks", 4)
    with pytest.raises(ValueError, match="has no nn.ModuleList of blocks"):
        block_list(nn.Linear(2, 2))


def test_workload_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown model 'vgg'; allowed: gpt"):
        Workload(model="vgg", size="small")
    with pytest.raises(ValueError, match="unknown size 'huge'; allowed: tiny, small, large"):
        Workload(model="gpt", size="huge")


@pytest.mark.parametrize("peer", [
    strategies.PerBlockCheckpoint(name="per-block"),
    strategies.SqrtSequential(name="sqrt"),
    strategies.TitanSelective(name="titan"),
], ids=lambda p: p.name)
def test_eager_peers_give_bit_identical_gradients(peer: strategies.Peer) -> None:
    torch.manual_seed(0)
    reference = _runner(strategies.NoRecompute(name="none"))
    run = _runner(peer)
    check = compare_grads(run, reference)
    assert check.identical and check.max_abs_diff == 0.0
    for got, want in zip(run.grads, reference.grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_attention_core_recipe_checkpoints_only_the_core() -> None:
    """Megatron's recipe: the same gradients as no recomputation, and only the core's ops run
    twice (two score bmms, softmax and the dropout's draw per block: 4 blocks)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from benchmarks._peers.runner import step

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: dict[str, int] = defaultdict(int)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            self.calls[str(func)] += 1
            return func(*args, **(kwargs or {}))

    reference = _runner(strategies.NoRecompute(name="none"))
    run = _runner(strategies.AttentionCoreCheckpoint(name="megatron"))
    assert compare_grads(run, reference).identical
    counts = []
    for r in (reference, run):
        with Count() as count:
            step(r)
        counts.append(count.calls)
    extra = {k: counts[1][k] - counts[0].get(k, 0) for k in counts[1] if counts[1][k] != counts[0].get(k, 0)}
    assert extra["aten._softmax.default"] == 4 and extra["aten.bernoulli_.float"] == 4
    assert extra["aten.bmm.default"] == 4  # q k^T replayed; probs @ v is not (torch's early stop)
    assert "aten.addmm.default" not in extra
    with pytest.raises(strategies.PeerUnavailable, match="has no explicit attention core"):
        strategies.AttentionCoreCheckpoint(name="megatron").prepare(nn.Linear(2, 2), None)


def test_sqrt_sequential_keeps_hf_gpt2_gradients() -> None:
    pytest.importorskip("transformers")
    hf = Workload(model="hf:gpt2", size="tiny")
    reference = _runner(strategies.NoRecompute(name="none"), hf)
    for peer in (strategies.SqrtSequential(name="sqrt"), strategies.PerBlockCheckpoint(name="hf")):
        assert compare_grads(_runner(peer, hf), reference).identical


def test_compare_grads_reports_the_largest_difference() -> None:
    reference = _runner(strategies.NoRecompute(name="none"))
    run = _runner(strategies.NoRecompute(name="other"))
    run.grads[0] = run.grads[0] + 0.25
    check = compare_grads(run, reference)
    assert not check.identical
    assert check.max_abs_diff == pytest.approx(0.25)
    assert check.label == "differs (max |d| 2.50e-01)"


def test_allocator_peak_counts_resident_bytes_and_the_step_peak() -> None:
    model = nn.Linear(10, 10)  # 110 float32 parameters = 440 bytes

    def step() -> None:
        a = torch.empty(1000)
        b = torch.empty(2000)
        del a, b
        torch.empty(500)

    assert allocator_peak_bytes(model, step, torch.device("cpu")) == 440 + 4 * 3000


def test_rockmate_reports_what_stops_it() -> None:
    peer = strategies.Rockmate(name="rockmate 2.0.0")
    try:
        import rockmate  # noqa: F401
    except Exception as exc:
        with pytest.raises(strategies.PeerUnavailable, match=f"`import rockmate` fails: {type(exc).__name__}"):
            peer.prepare(nn.Linear(2, 2), torch.zeros(1, 2))
    else:
        if not torch.cuda.is_available():
            with pytest.raises(strategies.PeerUnavailable, match="hard-codes torch.device"):
                peer.prepare(nn.Linear(2, 2), torch.zeros(1, 2))


def _row(name: str, source: str, peak_mib: float, ms: float, identical: bool = True,
         accepted: bool | None = None) -> Row:
    return Row(name=name, mode="eager", source=source, detail="", peak_bytes=int(peak_mib * results.MIB),
               alloc_peak_bytes=None, cuda_peak_bytes=None, step_ms=ms, num_timed_steps=3, overhead_pct=None,
               grads_vs_eager="identical", grads_vs_mode="", identical=identical,
               accepted=identical if accepted is None else accepted)


def test_matches_pick_the_fastest_identical_remat_run_within_each_peak() -> None:
    rows = [
        _row("none", "peer", 10, 100), _row("full", "peer", 4, 150), _row("sqrt", "peer", 6, 130),
        _row("remat a", "remat", 4, 120), _row("remat b", "remat", 6, 110),
        _row("remat c", "remat", 5, 90, identical=False), _row("remat d", "remat", 7, 100),
        _row("remat e", "remat", 6, 105, identical=False, accepted=True),  # a chunked head, within its tolerance
    ]
    full, sqrt = results.matches(rows)
    assert (full.peer, full.remat, full.best_peer) == ("full", "remat a", "full")
    assert full.ratio == pytest.approx(120 / 150) and full.goal_met
    assert (sqrt.peer, sqrt.remat, sqrt.best_peer) == ("sqrt", "remat e", "sqrt")
    assert sqrt.ratio == pytest.approx(105 / 130) and sqrt.goal_met
    even = results.matches([_row("full", "peer", 4, 100), _row("remat a", "remat", 4, 100)])[0]
    assert even.ratio == pytest.approx(1.0) and even.goal_met  # uniform chains: at most the peer's time
    slow = results.matches([_row("full", "peer", 4, 100), _row("remat a", "remat", 4, 86)],
                           goal_ratio=results.HETEROGENEOUS_GOAL)[0]
    assert slow.ratio == pytest.approx(0.86) and not slow.goal_met


def test_matches_bound_the_ratio_by_the_step_without_recomputation() -> None:
    """none / peer is the least ratio any plan at the peer's peak can reach: 0.9 here, above the
    heterogeneous goal of 0.85, so the table says the goal is out of reach."""
    rows = [_row("none", "peer", 10, 90), _row("full", "peer", 4, 100), _row("remat a", "remat", 4, 95)]
    (full,) = results.matches(rows, goal_ratio=results.HETEROGENEOUS_GOAL)
    assert full.none_ms == 90 and full.bound == pytest.approx(0.9) and not full.goal_met
    line = results.match_table([full]).splitlines()[-1]
    assert line.endswith("| 0.95 | 0.95 | 0.90 | missed (out of reach: none / peer > goal) |")
    (reachable,) = results.matches([_row("none", "peer", 10, 70), *rows[1:]], goal_ratio=results.HETEROGENEOUS_GOAL)
    assert results.match_table([reachable]).splitlines()[-1].endswith("| 0.70 | missed |")


def test_tiny_end_to_end_run_writes_table_json_and_plot(tmp_path) -> None:
    from benchmarks import peers

    argv = ["--model", "gpt", "--size", "tiny", "--no-compile", "--repeats", "1", "--warmup", "1",
            "--frontier-points", "1", "--out", str(tmp_path)]
    assert peers.main(argv) == 0
    payload = json.loads((tmp_path / "gpt-tiny.json").read_text())
    names = [row["name"] for row in payload["rows"]]
    assert names[:4] == ["none", "per-block checkpoint", "checkpoint_sequential sqrt(N)", "torchtitan selective"]
    measured = [row for row in payload["rows"] if row["step_ms"] is not None]
    assert all(row["num_timed_steps"] == 1 and row["peak_bytes"] > 0 for row in measured)
    assert any(row["source"] == "remat" for row in payload["rows"])
    assert "| strategy | mode | peak MiB (tracker) | peak MiB (allocator) |" in (tmp_path / "gpt-tiny.md").read_text()
    assert (tmp_path / "gpt-tiny.png").read_bytes()[:4] == b"\x89PNG"
    assert not math.isnan(payload["elapsed_s"])


def test_bad_arguments_are_refused() -> None:
    from benchmarks import peers

    with pytest.raises(SystemExit):
        peers.parse_args(["--repeats", "0"])


def test_attention_core_benchmark_on_a_small_gpt(monkeypatch) -> None:
    from benchmarks import attention_core

    sizes = dict(num_layers=2, d_model=32, num_heads=4, seq_len=64, batch_size=2, dropout=0.1)
    monkeypatch.setitem(attention_core.SHAPES, "small", sizes)
    row = attention_core.measure("small", repeats=1)
    assert row["identical"]
    # a*s/h = 8: the core's scores, probabilities and dropout outweigh the matmul outputs it caches
    assert row["stored_core"] < row["stored_base"] and row["peak_act_core"] < row["peak_act_base"]
    assert abs(row["peak_error"]) <= 2.0
    assert 0 < row["rng_share"] < row["replay_share"] <= 100
    text = attention_core.markdown([row], repeats=1)
    assert "| small | 2 x 32 / 4 x 64 x 2, p=0.1 |" in text and "identical" in text


@pytest.mark.slow
def test_lm_head_benchmark_on_a_tiny_vocabulary(monkeypatch) -> None:
    from benchmarks import lm_head

    sizes = dict(vocab_size=4000, d_model=8, num_heads=2, num_layers=2, seq_len=64, batch_size=2)
    monkeypatch.setitem(lm_head.SHAPES, "tiny", sizes)
    result = lm_head.measure("tiny", repeats=1)
    rows = {row["name"]: row for row in result["rows"]}
    assert list(rows) == ["none", "HF checkpointing", "remat lowest peak, head kept", "remat lowest peak",
                          "remat optimal @ 60% of HF"]
    hf, lowest = rows["HF checkpointing"], rows["remat lowest peak"]
    assert hf["peak_vs_hf"] == 1.0 and hf["time_vs_hf"] == 1.0
    # 128 tokens of 4000 logits (2 MiB in fp32) against 1 MiB of model state: the head is the peak
    assert lowest["head"].startswith("chunked:") and lowest["peak_vs_hf"] < rows["remat lowest peak, head kept"]["peak_vs_hf"]
    assert lowest["peak_mib"] == pytest.approx(lowest["predicted_peak_mib"], rel=0.02)
    assert lowest["grads"].startswith("ok: every gradient") and rows["remat lowest peak, head kept"]["grads"] == "identical"
    assert "| remat lowest peak |" in lm_head.markdown([result])


def test_zoo_benchmark_on_the_unet(tmp_path, monkeypatch) -> None:
    from benchmarks import zoo

    row = zoo.measure("unet", repeats=1)
    assert row["stacks"] == [["down", 3], ["up", 2]] and row["blocks"] == 5 and row["chain_breaks"] == 4
    assert row["hf_checkpointing_peak_bytes"] is None  # not a Hugging Face model
    assert row["least_measured_bytes"] < row["none_peak_bytes"]
    assert abs(row["least_error_pct"]) <= 2.0 and abs(row["half_error_pct"]) <= 2.0
    assert row["grads_identical"] and row["grads_ok"] and row["counts_match"] and row["heads"] == ["keep", "keep"]
    text = zoo.markdown([row], repeats=1)
    assert "| unet | down (3), up (2) |" in text and "| n/a | " in text and "identical, as planned" in text
    monkeypatch.setattr(zoo, "measure", lambda name, repeats: row)
    monkeypatch.setattr(sys, "argv", ["zoo", "--models", "unet", "--repeats", "1", "--json", str(tmp_path / "z.json"),
                                      "--markdown", str(tmp_path / "z.md")])
    zoo.main()
    assert json.loads((tmp_path / "z.json").read_text()) == [row]
    assert (tmp_path / "z.md").read_text() == text + "\n"


def test_zoo_benchmark_measures_hugging_face_checkpointing() -> None:
    pytest.importorskip("transformers")
    from benchmarks import zoo

    model = zoo.build_zoo("bert")
    assert zoo.step_peak_bytes(model, hf_checkpointing=True) < zoo.step_peak_bytes(model, hf_checkpointing=False)


def test_zoo_planning_benchmark_on_the_unet(tmp_path, monkeypatch) -> None:
    from benchmarks import zoo_planning

    row = zoo_planning.measure("unet", rounds=1)
    assert row["model"] == "unet" and row["blocks"] == 5 and row["frontier_plans"] >= 2
    assert all(0.0 <= row[c] < 5.0 for c in zoo_planning.COLUMNS)
    text = zoo_planning.markdown([row], rounds=1)
    assert text.startswith("| model | blocks | frontier plans | pareto: CPU s |") and "| unet | 5 |" in text
    monkeypatch.setattr(zoo_planning, "measure", lambda name, rounds: row)
    monkeypatch.setattr(sys, "argv", ["zoo_planning", "--models", "unet", "--rounds", "1", "--markdown", str(tmp_path / "p.md")])
    zoo_planning.main()
    # the last line carries the load average, which moves between the two calls
    assert (tmp_path / "p.md").read_text().splitlines()[:-1] == text.splitlines()[:-1]


def _tiny_profile(workload: Workload):
    from benchmarks._peers.suite import remat_profile

    return remat_profile(workload), workload.build().model


def test_parity_layouts_are_the_recipes_choices() -> None:
    """Each recipe written as remat segments on the tiny GPT (4 blocks): per block, checkpoint_sequential's
    2 segments of 2 with the last one kept, torchtitan's every other matmul, Megatron's core from q, k, v
    (the cores profiled as blocks of their own)."""
    from benchmarks._peers import parity

    profile, model = _tiny_profile(TINY)
    kinds = lambda segs: [(s.start, s.stop, s.strategy) for s in segs]  # noqa: E731
    assert kinds(parity.per_block_layout(profile, model)) == [(i, i + 1, "recompute") for i in range(4)]
    assert kinds(parity.sequential_layout(profile, model)) == [(0, 2, "recompute"), (2, 3, "keep"), (3, 4, "keep")]
    titan = parity.titan_layout(profile, model)
    # addmm: qkv, attention out, fc, mlp out: the 1st and 3rd are saved; bmm is not on torchtitan's list
    assert {s.saved_ops for s in titan} == {("aten.addmm.default#0", "aten.addmm.default#2")}
    from benchmarks._peers.suite import remat_profile

    cores = remat_profile(TINY, blocks=parity.CORE_BLOCKS)
    assert [b.name for b in cores.blocks] == [f"blocks.{i}.attn.core" for i in range(4)]
    assert kinds(parity.core_layout(cores, model)) == [(i, i + 1, "recompute") for i in range(4)]
    # a core's forward: q k^T (operand copies, bmm), scale, mask, softmax, dropout, @ v
    assert [op.name.split(".")[1] for op in cores.blocks[0].ops if not op.is_view].count("bmm") == 2
    unet = Workload(model="unet", size="tiny")
    profile, model = _tiny_profile(unet)
    assert [s.strategy for s in parity.per_block_layout(profile, model)] == ["recompute"] * 5


def test_parity_run_holds_no_more_than_each_recipe(tmp_path) -> None:
    """`--parity` on the tiny GPT: every recipe and remat's plan of its layout, identical gradients,
    remat's measured peak no larger than the recipe's; Markdown and JSON written."""
    from benchmarks import peers

    argv = ["--model", "gpt", "--size", "tiny", "--repeats", "2", "--warmup", "1", "--parity", "--out", str(tmp_path)]
    assert peers.main(argv) == 0
    payload = json.loads((tmp_path / "gpt-tiny-parity.json").read_text())
    assert [p["recipe"] for p in payload["pairs"]] == [
        "per-block checkpoint", "checkpoint_sequential sqrt(N)", "torchtitan selective", "Megatron attention core"]
    for pair in payload["pairs"]:
        assert pair["identical"] and len(pair["ratios"]) == 2
        assert pair["remat_peak_bytes"] <= pair["recipe_peak_bytes"], pair["recipe"]
    assert "| recipe | remat plan of its layout |" in (tmp_path / "gpt-tiny-parity.md").read_text()


@pytest.mark.parametrize("model", ["resnet", "unet", "hf:swin", "hf:llama"])
def test_heterogeneous_workloads_run_against_per_block_checkpointing(model: str) -> None:
    """The tiny heterogeneous workloads: the peers that run on them and remat's plan at each peer's
    peak (predicted to fit it) give the gradients of no recomputation."""
    if model.startswith("hf:"):
        pytest.importorskip("transformers")
    from benchmarks.peers import run_suite

    workload = Workload(model=model, size="tiny")
    assert workload.heterogeneous
    peers = [strategies.NoRecompute(name="none"), strategies.PerBlockCheckpoint(name="per-block checkpoint")]
    suite = run_suite(workload, peers, repeats=1, warmup=1, frontier_points=0)
    all_rows = results.rows(suite)
    assert [r.name for r in all_rows if r.source == "peer"] == ["none", "per-block checkpoint"]
    assert all(r.identical for r in all_rows), [(r.name, r.grads_vs_eager) for r in all_rows]
    peaks = {r.name: r.peak_bytes for r in all_rows}
    planned = {r.name: r.plan for r in suite.runners if r.source == "remat"}
    assert set(planned) == {"remat @ none", "remat @ per-block checkpoint"}
    for name, plan in planned.items():
        assert plan.prediction.peak_bytes <= peaks[name.removeprefix("remat @ ")]


def test_plans_that_differ_only_in_the_head_are_measured_apart() -> None:
    """`add_remat` keeps one runner per distinct plan: the same segments with another head are
    another plan (a chunked loss changes the peak and the gradients' rounding)."""
    import dataclasses

    import remat
    from benchmarks._peers.suite import _plan_key

    profile, _ = _tiny_profile(TINY)
    plan = remat.plan(profile, strategy="full")
    assert _plan_key(plan) == _plan_key(dataclasses.replace(plan, budget_bytes=1))
    assert _plan_key(plan) != _plan_key(dataclasses.replace(plan, head="recompute"))


def test_time_model_table_tells_a_stated_tolerance_from_a_difference():
    from benchmarks import time_model

    base = dict(model="gpt", peak_error=0.0, predicted_overhead=10.0, measured_overhead=12.0, step_error=1.8,
                drift=0.0, baseline_ms=10.0)
    rows = [dict(base, plan="none", identical=True, ok=True, tolerance=0.0, max_rel=0.0),
            dict(base, plan="optimal @ 46%", identical=False, ok=True, tolerance=1e-5, max_rel=4.9e-7),
            dict(base, plan="full", identical=False, ok=False, tolerance=0.0, max_rel=0.0)]
    table = time_model.markdown(rows, repeats=3)
    assert "| optimal @ 46% |" in table and "| within 1e-05 (max 4.9e-07) |" in table
    assert table.count("| DIFFER |") == 1 and table.count("| identical |") == 1


def test_runtime_overhead_benchmark_times_the_three_ways_from_the_same_weights(capsys) -> None:
    """A tiny chain (3 blocks, 2 rounds): one Markdown row with the three medians; the per-block
    differences are derived from them (what remat adds: remat - checkpoint, per block)."""
    from benchmarks import runtime_overhead

    row = runtime_overhead.measure(3, 4, rounds=2, warmup=1)
    ms = row["step_ms"]
    assert set(ms) == {"plain", "checkpoint", "remat"} and all(v > 0 for v in ms.values())
    assert row["remat_us_per_block"] == pytest.approx(1e3 * (ms["remat"] - ms["checkpoint"]) / 3)
    assert runtime_overhead.markdown(row).splitlines()[2].startswith("| 3 | 4 | 2 | ")
    assert runtime_overhead.main(["--blocks", "2", "--rounds", "1"]) == 0
    assert "| blocks | width | rounds |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        runtime_overhead.main(["--blocks", "0"])


def test_a_chunked_head_plan_is_held_to_its_tolerance_not_to_bit_identity() -> None:
    """A remat plan that chunks the LM head sums the loss over tokens in another order, so its
    gradients differ in their last bits: the match accepts it within the head's stated relative
    tolerance (`remat.apply.head.head_tolerance`), and not a larger difference."""
    import dataclasses

    import remat
    from benchmarks._peers.suite import Suite, add_remat

    profile, _ = _tiny_profile(TINY)
    plan = dataclasses.replace(remat.plan(profile, strategy="full"), head="chunked:8")
    suite = Suite(workload=TINY)
    add_remat(suite, profile, [("chunked", plan)], strategies.EAGER, warmup_steps=1)
    (run,) = suite.runners
    reference = _runner(strategies.NoRecompute(name="none"))
    assert run.relative_tolerance == 1e-5  # fp32: a reassociation's bound
    check = compare_grads(run, reference)
    assert not check.identical and 0 < check.max_rel_diff <= 1e-5 and check.accepted
    assert check.label == f"within the chunked head's tolerance (rel {check.max_rel_diff:.1e} <= 1e-05)"
    run.grads[0] = run.grads[0] * (1 + 1e-3)
    check = compare_grads(run, reference)
    assert not check.accepted and check.label.startswith("differs (max |d| ")
    # a peer (or a plan with the head kept) has no tolerance: the same difference is refused
    peer = _runner(strategies.NoRecompute(name="other"))
    peer.grads[0] = peer.grads[0] * (1 + 1e-7)
    assert not compare_grads(peer, reference).accepted


def test_a_hugging_face_chunked_head_plan_gets_its_tolerance():
    """The tolerance is asked of the model as built: once applied, a Hugging Face model's forward
    no longer shows its labels argument, which read as a tolerance of 0 (Llama's chunked plans
    were held to bit-identity)."""
    pytest.importorskip("transformers")
    import dataclasses

    import remat
    from benchmarks._peers.suite import Suite, add_remat

    workload = Workload(model="hf:llama", size="tiny")
    profile, _ = _tiny_profile(workload)
    plan = dataclasses.replace(remat.plan(profile, strategy="full"), head="chunked:8")
    suite = Suite(workload=workload)
    add_remat(suite, profile, [("chunked", plan)], strategies.EAGER, warmup_steps=1)
    (run,) = suite.runners
    assert run.relative_tolerance == 1e-5


def test_peak_by_op_names_what_is_live_at_each_peak_and_restores_the_tracker(tmp_path) -> None:
    from benchmarks import peak_by_op
    from remat.measure.tracker import LiveTracker

    methods = {name: getattr(LiveTracker, name) for name in ("__torch_dispatch__", "_add_locked", "_shift", "__exit__")}
    lines = peak_by_op.run("cpu", tmp_path, ["selective:attention-core"], top=40)
    assert {name: getattr(LiveTracker, name) for name in methods} == methods
    headers = [line for line in lines if line.startswith("## ")]
    assert [h.split()[1] for h in headers] == ["convnet", "gpt"]
    assert all("(+0.00 %)" in h and h.endswith("as planned: True") for h in headers)
    assert (tmp_path / "peak_by_op.txt").read_text().splitlines() == lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["convnet-profile.json", "gpt-profile.json", "peak_by_op.txt"]
    # the convnet's baseline peak: the stem's and 4 units' 2 convolutions' outputs (9) and as many
    # ReLUs', each 4 x 8 x 16 x 16 floats (32 KiB): 0.28 MiB apiece, as printed
    convnet_baseline = lines[lines.index(headers[0]) + 2:lines.index(headers[0]) + 12]
    saved = {line.split()[-1]: float(line.split()[0]) for line in convnet_baseline if "activations      fwd" in line}
    assert saved["aten.relu.default"] == saved["aten.convolution.default"] == round(9 * 32 / 1024, 2)


def test_held_outputs_benchmark_prices_mistrals_attention_weights_in_every_layout() -> None:
    """Mistral with ``output_attentions=True``: each layer's weights (4 sequences x 2 heads x 32 x
    32 floats) held to the loss, and every keep/recompute layout's peak as predicted."""
    from benchmarks.held_outputs import layouts

    row = layouts("mistral")
    assert row["held"] == [4 * 2 * 32 * 32 * 4] * 2 and row["layouts"] == 4
    assert row["most_under"][0] == 0.0 and row["most_over"][0] == 0.0


def test_random_layouts_benchmark_measures_each_layout_against_its_prediction(capsys) -> None:
    from benchmarks import random_layouts

    row = random_layouts.run("masked-rows", 3)
    assert row["blocks"] == 4 and row["layouts"] == 3 and row["missed"] == []
    assert all(error == 0 and identical for error, _, identical in row["errors"])
    random_layouts.main(["--models", "ctx-tensor", "--layouts", "2"])
    assert "| ctx-tensor | 4 | 2 | True | 0 | 0 |" in capsys.readouterr().out


def test_random_layouts_benchmark_draws_layouts_of_hugging_face_models_with_lora(capsys) -> None:
    """``--hf``: a model type built as the sweep builds it, ``--hf-layers`` layers, fine-tuned
    with LoRA; its layouts measure as predicted (GPT-2's, to the byte)."""
    from benchmarks import random_layouts

    random_layouts.main(["--models", "--hf", "gpt2", "--hf-layers", "3", "--lora", "4", "--layouts", "3"])
    assert "| hf:gpt2 + LoRA 4 (dropout 0.1) | 3 | 3 | True | 0 | 0 |" in capsys.readouterr().out


def test_random_layouts_benchmark_runs_a_model_under_autocast(capsys) -> None:
    """``--autocast``: the forward under bfloat16 autocast, entered inside the model as the README
    has it; GPT-2's layouts measure as predicted to the byte there too. ``--diffusers`` names a row
    that says why it did not run where diffusers is not installed."""
    import importlib.util

    from benchmarks import random_layouts

    args = ["--models", "--hf", "gpt2", "--hf-layers", "2", "--autocast", "--layouts", "3", "--diffusers", "dit"]
    random_layouts.main(args)
    out = capsys.readouterr().out
    assert "| hf:gpt2 under autocast | 2 | 3 | True | 0 | 0 |" in out
    if importlib.util.find_spec("diffusers") is None:
        assert "| df:dit | - | - | - | not run: " in out
    else:
        assert "| df:dit | 4 | 3 | True | 0 |" in out
