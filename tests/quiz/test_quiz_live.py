"""Each live demonstration measures its claim with remat's own stages, and the claim holds."""

from __future__ import annotations

import json

import pytest
import torch

from remat.quiz import LANGUAGES, load_quiz
from remat.quiz.live import DEMONSTRATIONS, Demonstration, demonstrate, fitted_exponent

pytestmark = pytest.mark.slow

QUESTION_IDS = [q.id for q in load_quiz("en").questions]


class _Measured(dict):
    """Question id -> its demonstration, measured on first use (on one thread) and kept.

    Lazy, so that a test process (one xdist worker) measures only what its tests use."""

    def __missing__(self, qid: str) -> Demonstration:
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        torch.manual_seed(0)
        try:
            self[qid] = demonstrate(qid)
        finally:
            torch.set_num_threads(before)
        return self[qid]


_MEASURED = _Measured()


@pytest.fixture
def demos() -> _Measured:
    return _MEASURED


def test_every_question_has_a_demonstration():
    assert sorted(DEMONSTRATIONS) == sorted(QUESTION_IDS)


def test_fitted_exponent_is_exact_on_power_laws():
    assert fitted_exponent([16, 64, 256], [4.0, 8.0, 16.0]) == pytest.approx(0.5, abs=1e-12)
    assert fitted_exponent([16, 64, 256], [3 * 16, 3 * 64, 3 * 256]) == pytest.approx(1.0, abs=1e-12)


def test_unknown_question_is_a_clear_error():
    with pytest.raises(LookupError, match=r"no live measurement for question 'nope'; available: "):
        demonstrate("nope")


@pytest.mark.parametrize("qid", QUESTION_IDS)
@pytest.mark.parametrize("language", LANGUAGES)
def test_every_claim_renders_in_both_languages(demos, language, qid):
    for q in [q for q in load_quiz(language).questions if q.id == qid]:
        line = q.live_claim.format(**demos[q.id].values)
        assert "{" not in line and len(line) > 20
        for row in demos[q.id].rows:
            assert row.label in load_quiz(language).live_labels, row.label
            assert "{" not in load_quiz(language).label(row.label, **row.fields)


def test_q1_full_recomputation_costs_flops_not_gradients(demos):
    d = demos["tradeoff"]
    assert d.holds
    assert d.values["extra_gflops"] > 0 and d.values["grads_identical"] is True
    # the replay is one forward of the blocks: between 0 and 1/2 of a step's FLOPs (backward ~ 2x forward)
    assert 0 < d.values["extra_flops_pct"] < 50
    # the planner's prediction (from the profiled block FLOPs) equals the FLOPs counted in the replay
    assert d.values["predicted_extra_gflops"] == d.values["extra_gflops"]


def test_q2_autograd_saves_bytes_in_every_block_and_names_the_ops(demos):
    d = demos["why-saved"]
    assert d.holds and d.values["saved_kib_per_block"] > 0
    ops = [row.fields["op"] for row in d.rows if row.label == "saving_op"]
    assert "addmm" in ops and "dropout mask" in ops and "_softmax" in ops
    # one GPT block at d_model=128: 2 LayerNorms (2*256) + qkv (128*384+384) + proj (128*128+128)
    # + fc (128*512+512) + out (512*128+128) = 198,272 fp32 weights = 774.5 KiB
    assert d.values["params_kib_per_block"] == 198_272 * 4 / 1024


def test_q3_same_strategy_costs_differ_between_models(demos):
    d = demos["measure-overhead"]
    assert d.holds
    assert abs(d.values["extra_flops_a_pct"] - d.values["extra_flops_b_pct"]) >= 5.0


def test_q4_sqrt_segments_give_square_root_scaling(demos):
    d = demos["sqrt-n"]
    assert d.holds and 0.4 <= d.values["exponent"] <= 0.6
    assert d.values["exponent_none"] > 0.9
    assert all(s < n for s, n in zip(d.values["sqrt_kib"], d.values["none_kib"]))


def test_q5_selective_sits_between_keep_and_full(demos):
    d = demos["selective"]
    assert d.holds
    v = d.values
    assert v["full_kib"] <= v["selective_kib"] < v["keep_kib"]
    assert v["selective_extra_gflops"] < v["full_extra_gflops"]
    assert v["selective_kib"] < 0.7 * v["keep_kib"]


def test_q6_disk_offload_moves_activations_out_of_memory(demos):
    d = demos["offload"]
    assert d.holds and d.values["grads_identical"] is True
    assert d.values["after_kib"] < d.values["before_kib"] and d.values["offloaded_kib"] > 0


def test_q7_gradients_identical_with_rng_preserved_and_differ_without(demos):
    d = demos["rng"]
    assert d.holds
    assert d.values["identical_preserved"] is True and d.values["diff_preserved"] == 0.0
    assert d.values["differ_not_preserved"] is True and d.values["diff_not_preserved"] > 0.0


def test_q8_planner_names_optimizer_state_as_the_reason(demos):
    d = demos["optimizer-state"]
    assert d.holds
    assert "optimizer state" in d.values["reason"].lower()
    assert d.values["optimizer_state_kib"] > d.values["budget_kib"]
    # mlp depth 2, width 1024: 3 Linear(1024, 1024) = 3 * 1,049,600 fp32 weights; AdamW keeps 2 moments each
    assert d.values["param_kib"] == 3 * 1_049_600 * 4 / 1024
    assert d.values["optimizer_state_kib"] == 2 * d.values["param_kib"]


RENDERED = ("why-saved", "rng", "optimizer-state")
"""The cheapest three: the command's rendering is the same for every demonstration."""


def test_cli_live_renders_demonstrations(demos, invoke, monkeypatch):
    # measurements taken above, rendered by the command (not measured a second time)
    monkeypatch.setattr("remat.quiz.live.DEMONSTRATIONS", {qid: (lambda d=demos[qid]: d) for qid in RENDERED})
    result = invoke("quiz", "--answers", "B,D,A,C,D,B,C,A", "--lang", "en", "--live", env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert result.stdout.count("Measured on this machine by remat") == 3
    assert result.stdout.count("(holds)") == 3 and "does NOT hold" not in result.stdout
    assert result.stdout.count("No live measurement for this question") == 5
    assert "the planner's answer" in result.stdout and "dropout mask" in result.stdout
    vi = invoke("quiz", "--answers", "B,D,A,C,D,B,C,A", "--lang", "vi", "--live", env={"COLUMNS": "400"})
    assert vi.stdout.count("Đo trên máy này bằng remat") == 3 and vi.stdout.count("(đúng)") == 3
    assert "câu trả lời của bộ lập kế hoạch" in vi.stdout
    doc = json.loads(invoke("quiz", "--answers", "B,D,A,C,D,B,C,A", "--json", "--live").stdout)
    assert [qid for qid, entry in doc["live"].items() if entry["available"] and entry["holds"]] == list(RENDERED)
