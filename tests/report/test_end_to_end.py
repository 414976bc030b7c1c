"""The report from the real producers: remat.profile on the built-in GPT, the planners,
remat.verify, and the `remat report` command on their JSON files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import remat
from remat.cli import app
from remat.models.registry import build
from remat.plan.planners import pareto, plan
from remat.report.frontier import FRONTIER_LABEL, plot_frontier
from remat.report.summary import summary_sentence
from remat.report.units import byte_scale, format_bytes

pytestmark = pytest.mark.slow

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "report"


@pytest.fixture(scope="module")
def produced(tmp_path_factory):
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared, busy machine: one thread is ten times faster here
    try:
        return _produce(tmp_path_factory)
    finally:
        torch.set_num_threads(threads)


def _produce(tmp_path_factory):
    built = build("gpt", num_layers=2, d_model=32, num_heads=2, seq_len=16, batch_size=2, vocab_size=64)
    profile = remat.profile(built.model, built.batch, built.loss_fn, built.optimizer, warmup=0, repeats=1)
    none = plan(profile, None, "none")
    budget = plan(profile, None, "full").prediction.peak_bytes
    # The verified plan recomputes whole blocks and is the only one that fits the budget: the
    # chosen one, so the summary carries its measurement.
    full = plan(profile, budget, "full")
    plans = [none, full]
    verification = remat.verify(built.model, built.batch, full, built.loss_fn, built.optimizer, repeats=1)
    folder = tmp_path_factory.mktemp("e2e")
    paths = [folder / "profile.json"] + [folder / f"plan-{p.strategy_name}.json" for p in plans]
    profile.save(paths[0])
    for path, p in zip(paths[1:], plans):
        p.save(path)
    verification.save(folder / "verification.json")
    return profile, plans, pareto(profile), [*paths, folder / "verification.json"], verification


def test_report_command_on_real_profile_and_plans(produced):
    profile, plans, _, paths, verification = produced
    out = ARTIFACTS / "gpt-report.html"  # kept for a person to open
    result = CliRunner().invoke(app, ["report", *map(str, paths), "-o", str(out)])
    assert result.exit_code == 0, result.output
    page = out.read_text(encoding="utf-8")
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page))
    sentence = summary_sentence(profile, plans, [verification])
    assert sentence in text.replace("&#x27;", "'")
    assert sentence.startswith(f"The full plan fits {format_bytes(budget_of(plans))} at ")
    assert sentence.endswith("gradients bit-identical.")  # CPU: the planned step is exact
    assert f"Measured: peak {format_bytes(verification.measured_peak_bytes)}" in text
    assert verification.timeline, "verify records the planned step's timeline"
    for p in plans:
        assert format_bytes(p.prediction.peak_bytes) in text
    for block in profile.blocks:
        assert block.name in text
    assert f"peak {format_bytes(profile.peak_bytes)}" in text
    assert profile.fingerprint.model_hash in text
    assert "http:" not in page and "https:" not in page
    assert page.count('src="data:image/svg+xml;base64,') == 4  # frontier, breakdown, timeline, blocks


def budget_of(plans):
    return plans[-1].budget_bytes


def test_frontier_from_pareto_plans(produced):
    profile, plans, frontier, _, _ = produced
    ax = plot_frontier(profile, plans, frontier=frontier).axes[0]
    (line,) = [ln for ln in ax.get_lines() if ln.get_label() == FRONTIER_LABEL]
    peaks = sorted({p.prediction.peak_bytes for p in frontier})
    assert len(line.get_xdata()) == len(peaks) >= 2
    scale = byte_scale(max(peaks))
    assert ax.get_xlabel().endswith(f"({scale.unit})")
    assert list(line.get_xdata()) == [scale(b) for b in peaks]
