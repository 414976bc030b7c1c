"""The estimate benchmarks keep working: their cheap parts on small inputs."""

from __future__ import annotations

import json

from benchmarks import estimate_published, estimate_speed


def test_zero_table_and_markdown() -> None:
    rows = estimate_published.zero_table()
    assert len(rows) == 18  # shards round up to whole bytes: a few bytes in 10^9
    assert all(abs(r[f"published_{s}"] - r[f"remat_{s}"]) < 1e-8 for r in rows for s in (1, 2, 3))
    text = estimate_published.markdown(dict(gpt3_layers=[], gpt3_stages=[], zero=rows[:1], titan=[]))
    assert "| 7.5B | 1 | 120.00 / 120.00 | 120.00 / 120.00 | 120.00 / 120.00 |" in text
    head = dict(layout="dp8 ZeRO-3", head="chunked:256", logits_gib=3.9, post_peak_gib=1.66, replay_tflop=8.6,
                none_peak_gib=68.5, full_peak_gib=19.2)
    text = estimate_published.markdown(dict(gpt3_layers=[], gpt3_stages=[], zero=[], titan=[], heads=[head]))
    assert "| dp8 ZeRO-3 | chunked:256 | 3.90 | 1.66 | 8.6 | 68.50 | 19.20 |" in text


def test_speed_commands_and_summaries(tmp_path) -> None:
    argv = estimate_speed.commands(tmp_path)
    assert set(argv) == {"llama70b", "mixtral", "search"}
    assert json.loads((tmp_path / "mixtral-8x7b.json").read_text())["num_local_experts"] == 8
    assert "--search" in argv["search"] and "--expert-parallel" in argv["mixtral"]
    found = [dict(parallelism=dict(data=2, tensor=4, pipeline=2, virtual_stages=1, context=1, expert=1), zero_stage=1,
                  micro_batch=1, micro_batches=8, strategy="none", step_s=1.5, peak_bytes=2**31, mfu=0.4)]
    assert estimate_speed.summary(found) == ["dp2 tp4 pp2 ZeRO-1 mb=1 m=8 none, head keep: 1.50 s, 2.0 GiB, MFU 40.0%"]
    chunked = [dict(found[0], head="chunked:256")]
    assert estimate_speed.summary(chunked) == ["dp2 tp4 pp2 ZeRO-1 mb=1 m=8 none, head chunked:256: 1.50 s, 2.0 GiB, MFU 40.0%"]
