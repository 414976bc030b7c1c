"""The HTML page holds the numbers of its inputs, embeds everything and names no external URL."""

import base64
import html
import dataclasses
import re
import xml.etree.ElementTree as ET

import pytest

from report_samples import make_plans, make_profile, make_verification
from remat.report.html import render_html, write_report

EXTERNAL = ("http:", "https:", "//cdn", "ftp:", "src=\"//", "href=\"//", "@import", "url(", "<script", "<link rel=\"stylesheet")


@pytest.fixture(scope="module")
def page(sample_report) -> str:
    return sample_report.read_text(encoding="utf-8")


def test_page_holds_the_numbers_of_its_inputs(page):
    text = re.sub(r"<[^>]+>", " ", page)
    assert "The optimal plan fits 80.0 MiB at +13% step time, 2.4x less activation memory" in text
    for plan_row in ("optimal @ 80.0 MiB", "79.0 MiB", "34.0 ms", "+13%", "6.0 GFLOP, 4.0 ms", "16.0 MiB",
                     "blocks.3 (block)", "81.0 MiB (+2.5%)", "35.0 ms (-2.1% side by side)"):
        assert plan_row in text, plan_row
    for block_fact in ("blocks.0", "Block", "8.0 MiB", "1.0 MiB", "2.0 ms", "4.0 ms", "offload:cpu", "recompute", "2.0 GFLOP"):
        assert block_fact in text, block_fact
    for env_fact in ("Test CPU 3000", "2.13.0", "3.11.9", "bench-host", "4x128:int64", "c0ffee12", "AdamW",
                     "500.0 MiB/s", "30.5 ms, peak 101.0 MiB"):
        assert env_fact in text, env_fact
    assert "bit-identical" in text and "as planned" in text
    assert "<th>fits 80.0 MiB</th>" in page
    assert "remat run --model gpt --budget 80MiB" in text
    assert 'plan = remat.Plan.load("plan.json")  # optimal @ 80.0 MiB' in html.unescape(text)
    assert "remat.apply_(model, plan, batch=batch)" in text


def test_page_is_self_contained(page):
    lowered = page.lower()
    for needle in EXTERNAL:
        assert needle not in lowered, needle
    assert "<style>" in page and 'name="viewport"' in page
    srcs = re.findall(r'src="([^"]*)"', page)
    assert len(srcs) == 4 and all(s.startswith("data:image/svg+xml;base64,") for s in srcs)
    for src in srcs:
        svg = base64.b64decode(src.split(",", 1)[1])
        assert ET.fromstring(svg).tag.endswith("svg")
    hrefs = re.findall(r'href="([^"]*)"', page)
    assert hrefs[0] == "data:," and all(h.startswith("#") for h in hrefs[1:])  # only in-page links
    assert hrefs[1:] == ["#plans", "#figures", "#blocks", "#verify", "#environment", "#reproduce"]


def test_page_sections_and_figures(page):
    for anchor in ("summary", "plans", "figures", "blocks", "verify", "environment", "reproduce"):
        assert f'id="{anchor}"' in page
    for name in ("frontier", "breakdown", "timeline", "blocks"):
        assert f'id="fig-{name}"' in page


def test_cuda_max_allocated_is_shown_when_measured():
    profile = dataclasses.replace(make_profile(timeline=False), device_max_allocated_bytes=3 * 2**30)
    text = re.sub(r"<[^>]+>", " ", render_html(profile))
    assert re.search(r"device max allocated \(baseline\)\s+3.0 GiB", text)
    assert "device max allocated" not in render_html(make_profile(timeline=False))


def test_op_count_mismatches_are_listed():
    ver = make_verification(timeline=False)
    bad = dataclasses.replace(ver, recompute_counts_match=False, op_counts=(
        dataclasses.replace(ver.op_counts[0], planned_count=5),))
    page = render_html(make_profile(timeline=False), verifications=[bad])
    text = re.sub(r"<[^>]+>", " ", page)
    assert "MISMATCH" in text
    assert re.search(r"optimal\s+blocks.1\s+aten.mm.default\s+3\s+5\s+4", text)


def test_plan_of_another_model_is_refused_before_drawing():
    profile = make_profile(timeline=False)
    fewer = dataclasses.replace(profile, blocks=profile.blocks[:3])
    with pytest.raises(ValueError, match=r"pass the profile the plan was made from"):
        render_html(fewer, [make_plans()["full"]])


def test_text_is_escaped():
    page = render_html(make_profile(), commands=["remat run --name '<b>&'"])
    assert "&lt;b&gt;&amp;" in page and "<b>&" not in page


def test_page_without_plans_or_timeline():
    page = render_html(make_profile(timeline=False))
    assert "No plan given: without recomputation the step peaks at 101.0 MiB" in page
    assert 'id="fig-breakdown"' in page
    assert 'id="fig-frontier"' not in page and 'id="fig-timeline"' not in page
    assert 'id="plans"' not in page and 'id="verify"' not in page
    assert "No command recorded" in page


def test_write_report_and_figure_files(tmp_path):
    # no plan, no timeline: the breakdown is the only figure (keeps the test fast)
    path = write_report(tmp_path / "out" / "report.html", make_profile(timeline=False),
                        figures_dir=tmp_path / "figs")
    assert path == tmp_path / "out" / "report.html"
    assert path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == ["breakdown.png", "breakdown.svg"]
    with pytest.raises(ValueError, match=r"must end in .html; e.g. report.html"):
        write_report(tmp_path / "report.pdf", make_profile())


def test_timeline_shows_the_baseline_and_the_chosen_plan_only():
    from remat.report.html import report_figures

    chosen = make_verification()
    other = dataclasses.replace(chosen, strategy_name="full", budget_bytes=None)
    figures = report_figures(make_profile(), list(make_plans().values()), [other, chosen])
    labels = [ln.get_label() for ln in figures["timeline"].axes[0].get_lines()]
    assert labels == ["no recomputation (measured)", "optimal @ 80.0 MiB (measured)", "budget 80.0 MiB"]


def test_strategies_a_block_cannot_run_are_listed_with_why():
    profile = make_profile()
    assert "cannot run" not in render_html(profile)
    blocks = list(profile.blocks)
    blocks[2] = dataclasses.replace(blocks[2], unavailable=(("selective", "RuntimeError: mutated <after> caching"),))
    text = render_html(dataclasses.replace(profile, blocks=tuple(blocks)))
    assert "Strategies a block cannot run" in text
    assert "<td>blocks.2</td><td>2</td><td>selective</td><td>RuntimeError: mutated &lt;after&gt; caching</td>" in text
